"""A worker process: ranks 1..P x T - 1 of the model side (tensor-parallel ranks, pipeline stages),
started by `Executor`.

It joins the process groups, loads its shard of its stage's layers, agrees on the KV block count with
rank 0, warms up and captures its CUDA graphs, then runs its part of every `StepInput` rank 0 sends
until told to stop. It never samples and never answers a step over the pipe (a last stage sends its
logits to rank 0 through torch.distributed): rank 0 learns of trouble from the process's exit. It dies
with its parent (PR_SET_PDEATHSIG, even when the parent is SIGKILLed) and leaves Ctrl-C to the parent.
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
from typing import TYPE_CHECKING

from pagoda.service.engine.parent_death import die_with_parent
from pagoda.service.stop_relay import relay_stop_signals

if TYPE_CHECKING:
    from pagoda.service.engine.config import EngineConfig
    from pagoda.service.engine.runner.model_runner import ModelRunner


@dataclass(frozen=True)
class WorkerArgs:
    rank: int  # stage * tp_size + tp rank
    tp_size: int
    pp_size: int
    store_host: str  # where rank 0's TCPStore listens
    store_port: int
    backend: str  # "nccl" or "gloo"
    config: EngineConfig
    model_path: str
    eos_token_ids: frozenset[int]
    num_threads: int  # torch intra-op threads, as rank 0 has
    parent_pid: int
    relay_stop_signals: bool  # under `pagoda serve`: SIGTERM and SIGINT go to the core (stop_relay)
    collective_timeout_s: float
    log_level: int  # the root logger's level in rank 0's process


class _Stopped(Exception):
    """Rank 0 gave up during start-up and said so."""


def worker_main(args: WorkerArgs, conn: Connection) -> None:
    """The process's target. Messages to rank 0: ("hello", None) once imported, ("num_blocks", n)
    after loading, ("ready", None) after warm-up, or ("error", traceback) before exiting with 1."""
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
    try:
        runner = _start(args, conn)
    except _Stopped:
        return
    except BaseException:
        with contextlib.suppress(OSError):  # rank 0 is gone: nobody to tell
            conn.send(("error", traceback.format_exc()))
        sys.exit(1)
    conn.send(("ready", None))
    _serve(runner, conn)


def _rank_name(args: WorkerArgs) -> str:
    if args.pp_size == 1:
        return f"tp rank {args.rank}"
    stage, tp_rank = divmod(args.rank, args.tp_size)
    return f"rank {args.rank}: pp stage {stage}, tp rank {tp_rank}"


def _start(args: WorkerArgs, conn: Connection) -> ModelRunner:
    import torch
    import torch.distributed as dist

    from pagoda.service.engine.runner.model_runner import ModelRunner
    from pagoda.service.model.pipeline import init_groups

    torch.set_num_threads(args.num_threads)
    conn.send(("hello", None))
    device = torch.device("cuda", args.rank) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=args.collective_timeout_s)
    size = args.tp_size * args.pp_size
    store = dist.TCPStore(args.store_host, args.store_port, size, is_master=False, timeout=timeout)
    tp, pp = init_groups(
        args.rank, args.tp_size, args.pp_size, store, args.backend, device, args.collective_timeout_s
    )

    def agree_num_blocks(num_blocks: int) -> int:
        conn.send(("num_blocks", num_blocks))
        agreed = conn.recv()
        if agreed is None:
            raise _Stopped
        return int(agreed)

    return ModelRunner(args.config, args.model_path, set(args.eos_token_ids), tp, agree_num_blocks, pp)


def _serve(runner: ModelRunner, conn: Connection) -> None:
    import torch.distributed as dist

    while True:
        try:
            step = conn.recv()
        except EOFError:  # rank 0 closed the pipe without a word: it is gone
            break
        if step is None:
            break
        runner.forward(step)
    dist.destroy_process_group()
