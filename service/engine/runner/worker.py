"""A tensor-parallel worker process: ranks 1..N-1 of the model side, started by `Executor`.

It joins the process group, loads its shard, agrees on the KV block count with rank 0, warms up and
captures its CUDA graphs, then runs every `StepInput` rank 0 sends until told to stop. It never
samples and never answers a step: rank 0 learns of trouble from the process's exit. It dies with
its parent (PR_SET_PDEATHSIG, even when the parent is SIGKILLed) and leaves Ctrl-C to the parent.
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
    rank: int
    size: int
    store_port: int  # rank 0's TCPStore on 127.0.0.1
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
        format=f"%(asctime)s %(levelname)s %(name)s [tp rank {args.rank}]: %(message)s",
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


def _start(args: WorkerArgs, conn: Connection) -> ModelRunner:
    import torch
    import torch.distributed as dist

    from pagoda.service.engine.runner.model_runner import ModelRunner
    from pagoda.service.model.parallel import init_tp_group

    torch.set_num_threads(args.num_threads)
    conn.send(("hello", None))
    device = torch.device("cuda", args.rank) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=args.collective_timeout_s)
    store = dist.TCPStore("127.0.0.1", args.store_port, args.size, is_master=False, timeout=timeout)
    tp = init_tp_group(args.rank, args.size, store, args.backend, device, args.collective_timeout_s)

    def agree_num_blocks(num_blocks: int) -> int:
        conn.send(("num_blocks", num_blocks))
        agreed = conn.recv()
        if agreed is None:
            raise _Stopped
        return int(agreed)

    return ModelRunner(args.config, args.model_path, set(args.eos_token_ids), tp, agree_num_blocks)


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
