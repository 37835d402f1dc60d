"""A worker process: ranks 1..P x T - 1 of the model side (tensor-parallel ranks, pipeline stages),
started by `Executor` on the leader node, or by a headless node's agent (`service/headless.py`) for the
ranks of another node.

It joins the process groups, loads its shard of its stage's layers, agrees on the KV block count with
rank 0, warms up and captures its CUDA graphs, then runs its part of every `StepInput` rank 0 sends
until told to stop. It never samples and never answers a step (a last stage sends its logits to rank 0
through torch.distributed): rank 0 learns of trouble from the process's exit, or, from another node,
from its connection closing (`nodes.py`). It dies with its parent (PR_SET_PDEATHSIG, even when the
parent is SIGKILLed) and leaves Ctrl-C to the parent.

On the leader node `conn` is a pipe to rank 0. On a headless node the rank connects to rank 0 itself
(`nodes.py`) and `conn` is a pipe to its agent, which hears "joined", "ready" or "error" (its health).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from pagoda.service.engine.parent_death import die_with_parent
from pagoda.service.engine.runner.cpu_threads import share_cpus
from pagoda.service.engine.runner.nodes import STEP_PORT_KEY, connect, tell, wait_for_leader
from pagoda.service.stop_relay import relay_stop_signals

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from pagoda.service.engine.config import EngineConfig
    from pagoda.service.engine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# One worker's load + warm-up + CUDA graph capture of a large model; also how long the ranks of the other
# nodes and the leader wait for each other at start (a cold image pull on one node takes minutes).
START_TIMEOUT_S = 900.0
COLLECTIVE_TIMEOUT_S = 60.0  # every collective and transfer, and rank 0's store


@dataclass(frozen=True)
class WorkerArgs:
    rank: int  # stage * tp_size + tp rank, over all nodes
    tp_size: int
    pp_size: int
    store_host: str  # where rank 0's TCPStore listens
    store_port: int
    backend: str | None  # "nccl" or "gloo"; None: this node's (a headless node's ranks choose for themselves)
    config: EngineConfig
    model_path: str
    eos_token_ids: frozenset[int]
    num_threads: int | None  # torch intra-op threads, as rank 0 has; None: torch's default
    parent_pid: int
    relay_stop_signals: bool  # under `pagoda serve`: SIGTERM and SIGINT go to the parent (stop_relay)
    collective_timeout_s: float
    log_level: int  # the root logger's level in the parent's process
    is_remote: bool = False  # a headless node's rank: it connects to rank 0 itself
    start_timeout_s: float = START_TIMEOUT_S  # how long a remote rank waits for the leader and the others


class _Stopped(Exception):
    """Rank 0 gave up during start-up and said so."""


class _Refused(Exception):
    """Rank 0 refused this rank's hello (its node was started with other settings)."""


def worker_main(args: WorkerArgs, conn: Connection) -> None:
    """The process's target. Messages to rank 0 (`nodes.tell`, JSON): ("hello", {rank, ...}) once
    imported, ("num_blocks", n) after loading, ("ready", None) after warm-up, or ("error", traceback)
    before exiting with 1, at start or in a step. Rank 0 answers the hello with "start" once every
    rank has said it, the block count with the count all use, then sends steps, and None to stop."""
    die_with_parent(args.parent_pid)
    if args.relay_stop_signals:
        relay_stop_signals(args.parent_pid)
    else:  # an offline `LLM`: the caller's Ctrl-C is its own to handle; the workers follow rank 0
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s %(levelname)s %(name)s [{_rank_name(args)}]: %(message)s",
        stream=sys.stderr,
    )
    told = [conn]  # who hears of a failure: the parent, and rank 0 once connected
    try:
        import torch

        if args.num_threads is not None:
            torch.set_num_threads(args.num_threads)
        backend = args.backend or _backend(args.config)
        if args.num_threads is None and backend == "gloo":  # a headless node's CPU rank: as rank 0's node
            share_cpus(args.config.ranks_per_node)
        if args.is_remote:
            rank0, store = _join_remote(args, backend)
            told.append(rank0)
            tell(conn, "joined")
        else:
            rank0, store = conn, _join_local(args, conn)
        runner = _start(args, backend, rank0, store)
    except _Stopped:
        return
    except _Refused as exc:
        logger.error("rank 0 refused rank %d: %s", args.rank, exc)
        _tell_quietly(conn, "error", f"rank 0 refused rank {args.rank}: {exc}")
        sys.exit(1)
    except BaseException:
        failure = traceback.format_exc()
        if args.is_remote:
            logger.error("rank %d failed to start:\n%s", args.rank, failure)
        for peer in told:
            _tell_quietly(peer, "error", failure)
        sys.exit(1)
    tell(rank0, "ready")
    if args.is_remote:
        tell(conn, "ready")
    _serve(args, runner, rank0)


def _tell_quietly(conn: Connection, kind: str, value: Any) -> None:
    with contextlib.suppress(OSError):  # the peer is gone: nobody to tell
        tell(conn, kind, value)


def _rank_name(args: WorkerArgs) -> str:
    if args.pp_size == 1:
        return f"tp rank {args.rank}"
    stage, tp_rank = divmod(args.rank, args.tp_size)
    return f"rank {args.rank}: pp stage {stage}, tp rank {tp_rank}"


def _backend(config: EngineConfig) -> str:
    from pagoda.service.engine.runner.model_runner import resolve_device

    return "nccl" if resolve_device(config.device).type == "cuda" else "gloo"


def _await_start(conn: Connection, timeout_s: float | None) -> None:
    """Rank 0's answer to the hello: "start" once every rank has said hello (None: it gave up)."""
    if timeout_s is not None and not conn.poll(timeout_s):
        raise TimeoutError(f"rank 0 did not start the group in {timeout_s:.0f} s")
    answer = conn.recv()
    if answer is None:
        raise _Stopped
    if isinstance(answer, tuple) and answer[0] == "refused":
        raise _Refused(answer[1])
    if answer != "start":
        raise RuntimeError(f"rank 0 answered the hello with {answer!r}")


def _join_local(args: WorkerArgs, conn: Connection) -> dist.Store:
    import torch.distributed as dist

    tell(conn, "hello", {"rank": args.rank})
    _await_start(conn, None)
    timeout = timedelta(seconds=args.collective_timeout_s)
    size = args.tp_size * args.pp_size
    return dist.TCPStore(args.store_host, args.store_port, size, is_master=False, timeout=timeout)


def _join_remote(args: WorkerArgs, backend: str) -> tuple[Connection, dist.Store]:
    """A headless node's rank: wait for the leader's store, join it, connect to rank 0's step listener,
    say hello with the settings this node was started with, and wait for the group to start."""
    import torch.distributed as dist

    host, port, what = args.store_host, args.store_port, f"rank {args.rank}"
    wait_for_leader(host, port, args.start_timeout_s, what)
    timeout = timedelta(seconds=args.collective_timeout_s)
    size = args.tp_size * args.pp_size
    store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    rank0 = connect(host, int(store.get(STEP_PORT_KEY)))
    try:
        _device(args, backend)  # a node without the GPUs fails here, and rank 0 hears why at once
    except Exception:
        _tell_quietly(rank0, "error", traceback.format_exc())
        rank0.close()
        raise
    tell(rank0, "hello", {"rank": args.rank, "backend": backend, "settings": args.config.rank_settings()})
    _await_start(rank0, args.start_timeout_s)
    logger.info("joined rank 0 at %s:%d", host, port)
    return rank0, store


def _device(args: WorkerArgs, backend: str) -> torch.device:
    """This rank's device: its node's GPU r - k * R under NCCL, else the CPU."""
    import torch

    if backend != "nccl":
        return torch.device("cpu")
    device = torch.device("cuda", args.rank % args.config.ranks_per_node)
    if device.index >= torch.cuda.device_count():
        raise ValueError(
            f"rank {args.rank} runs on {device}, but this node has {torch.cuda.device_count()} GPUs: each "
            f"node needs {args.config.ranks_per_node}"
        )
    torch.cuda.set_device(device)
    return device


def _start(args: WorkerArgs, backend: str, rank0: Connection, store: dist.Store) -> ModelRunner:
    from pagoda.service.engine.runner.model_runner import ModelRunner
    from pagoda.service.model.pipeline import init_groups

    device = _device(args, backend)
    tp, pp = init_groups(
        args.rank, args.tp_size, args.pp_size, store, backend, device, args.collective_timeout_s
    )

    def agree_num_blocks(num_blocks: int) -> int:
        tell(rank0, "num_blocks", num_blocks)
        agreed = rank0.recv()
        if agreed is None:
            raise _Stopped
        return int(agreed)

    return ModelRunner(args.config, args.model_path, set(args.eos_token_ids), tp, agree_num_blocks, pp)


def _serve(args: WorkerArgs, runner: ModelRunner, rank0: Connection) -> None:
    import torch.distributed as dist

    while True:
        try:
            step = rank0.recv()
        except (EOFError, OSError) as exc:  # rank 0 closed without a word (or its node vanished): gone
            logger.error("rank 0 is gone (%s): rank %d stops", exc.__class__.__name__, args.rank)
            sys.exit(1)
        if step is None:
            break
        try:
            runner.forward(step)
        except Exception:
            failure = traceback.format_exc()
            logger.error("rank %d failed in a step:\n%s", args.rank, failure)
            _tell_quietly(rank0, "error", failure)
            sys.exit(1)
    dist.destroy_process_group()
