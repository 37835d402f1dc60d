"""The model side of the engine over all ranks: P pipeline stages of T tensor-parallel ranks.

Rank 0 (stage 0, tp rank 0) is this process: it runs its `ModelRunner` in place, prepares each step
and samples. Ranks 1..P x T - 1 are worker processes (`worker.py`; spawned, non-daemonic because this
process may itself be a daemonic child, and managed here) that run their part of the forward pass;
torch.distributed carries the collectives and the stage-to-stage transfers (NCCL on GPUs, rank r on
cuda:r; gloo on the CPU). With one rank there is no worker and no process group: `execute` is the
runner's, at no extra cost. Over N nodes (`EngineConfig.nnodes`) this process spawns only the leader's
ranks 1..R - 1; the ranks of the other nodes are started there (`pagoda serve --headless`) and connect
to this one (`nodes.py`): from then on a remote rank is a worker whose pipe is a TCP connection.

Transport: each step rank 0 pickles the `StepInput` (host arrays and a few row lists, never the
requests) once and writes it to one pipe per worker; workers never answer a step. Measured on the
CPU (2 cores, 36 KB for a 64-row decode step with 128-block tables, 54 KB for a 2048-token prefill):
~16 µs of pickling on rank 0, ~50 µs for a round trip to a worker and back (so ~25 µs until the
worker starts its forward), against the H200's ~5 ms decode step. A rank on another node gets the same
bytes over its own TCP connection (`nodes.py`): on a 2-core machine over the loopback, 32-47 µs of
rank 0's time for one remote rank against 20-34 for a pipe, 231-281 for eight against 136-212, and 58-92
µs until one remote rank has the step (`bench/step_transport.py`; docs/parallelism.md compares it with a
forwarder per node and a gloo broadcast).

Death: a worker's exit is seen on its process sentinel, a remote rank's on its connection, which closes
(or breaks within `nodes.DEAD_PEER_S` when its node vanished): one poll() before every step, ~1 µs, and a
poll loop while the GPU finishes a step, so a peer that died inside an NCCL collective is noticed at
once instead of when the collective times out. A gloo collective with a dead peer fails at once or
after `COLLECTIVE_TIMEOUT_S`. Either way `execute` raises RuntimeError naming the rank and its exit
code, and so does every call after it.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import multiprocessing as mp
import os
import pickle
import select
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.core.engine_core import PendingResult
from pagoda.service.engine.core.request import Request
from pagoda.service.engine.core.scheduler import GrammarBitmask, SchedulerOutput
from pagoda.service.engine.runner.cpu_threads import share_cpus
from pagoda.service.engine.runner.cuda_graphs import StepGraphs
from pagoda.service.engine.runner.model_runner import (
    ForwardedStep,
    KVCacheLayout,
    ModelRunner,
    PendingStep,
    StepResult,
    resolve_device,
)
from pagoda.service.engine.runner.nodes import STEP_PORT_KEY, StepListener, compare_settings, heard
from pagoda.service.engine.runner.worker import COLLECTIVE_TIMEOUT_S, START_TIMEOUT_S, WorkerArgs, worker_main
from pagoda.service.model.config import ModelConfig
from pagoda.service.model.llama import LlamaForCausalLM
from pagoda.service.model.pipeline import init_groups, log_split, split_layers

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 5.0
DEATH_GRACE_S = 5.0  # after a failed collective, how long a dying peer may take to show as exited


@dataclass
class _Worker:
    rank: int
    process: BaseProcess | None  # None: a rank of another node, known by its connection alone
    conn: Connection
    name: str  # in messages: "tensor-parallel worker rank 1", "worker rank 3 (pipeline stage 1, tp rank 1)"

    @property
    def fd(self) -> int:
        """What turns readable when the rank is gone: its process's sentinel, or its connection."""
        return self.process.sentinel if self.process is not None else self.conn.fileno()


class Executor:
    """`execute(scheduler_output) -> StepResult`, `kv`, `max_model_len`, `model_config` over every rank."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        eos_token_ids: set[int],
        relay_stop_signals: bool = False,
    ) -> None:
        self.tp_size = config.tensor_parallel_size
        self.pp_size = config.pipeline_parallel_size
        self.size = self.tp_size * self.pp_size
        self.nnodes = config.nnodes
        self.ranks_per_node = config.ranks_per_node
        self._relay_stop_signals = relay_stop_signals
        self._workers: list[_Worker] = []
        self._failure: str | None = None
        self._is_stopped = False
        self._store: dist.Store | None = None
        self._listener: StepListener | None = None  # over nodes, until the other nodes' ranks joined
        self._has_group = False
        self._poller = select.poll()
        self._finalizer: weakref.finalize[Any, Executor] | None = None
        if resolve_device(config.device).type == "cpu":
            share_cpus(self.ranks_per_node)
        if self.size == 1:
            self.runner = ModelRunner(config, model_path, eos_token_ids)
            return
        try:
            self.runner = self._start(config, model_path, eos_token_ids)
        except BaseException:
            self.shutdown()
            raise

    @property
    def kv(self) -> KVCacheLayout:
        return self.runner.kv

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def model_config(self) -> ModelConfig:
        return self.runner.model_config

    # Rank 0's, for benchmarks and checks that look inside (`pagoda bench`, `gpu_check`, tests).
    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def model(self) -> LlamaForCausalLM:
        return self.runner.model

    @property
    def graphs(self) -> StepGraphs | None:
        return self.runner.graphs

    # ---- start-up ------------------------------------------------------------------------------

    def _start(self, config: EngineConfig, model_path: str, eos_token_ids: set[int]) -> ModelRunner:
        if dist.is_initialized():
            raise RuntimeError(
                "a torch.distributed group already exists in this process (an engine not shut down?); "
                "one tensor-parallel engine per process"
            )
        device = resolve_device(config.device)
        if device.type == "cuda":
            num_gpus = torch.cuda.device_count()
            if num_gpus < self.ranks_per_node:
                ranks = f"tensor_parallel_size {self.tp_size}"
                if self.pp_size > 1:
                    ranks = f"pipeline_parallel_size {self.pp_size} x {ranks}"
                if self.nnodes > 1:
                    ranks = f"{ranks} over {self.nnodes} nodes"
                raise ValueError(
                    f"{ranks} needs {self.ranks_per_node} GPUs (one per rank) on each node; this machine "
                    f"has {num_gpus}"
                )
            if device.index not in (None, 0):
                raise ValueError(f"with several ranks rank r runs on cuda:r; got device {config.device!r}")
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        self._store = self._start_store(config)
        if self.nnodes > 1:  # the other nodes' ranks find its port in the store
            self._listener = StepListener(send_timeout_s=COLLECTIVE_TIMEOUT_S)
            self._store.set(STEP_PORT_KEY, str(self._listener.port))
        context = mp.get_context("spawn")
        for rank in range(1, self.ranks_per_node):
            args = WorkerArgs(
                rank=rank,
                tp_size=self.tp_size,
                pp_size=self.pp_size,
                store_host="127.0.0.1",
                store_port=self._store.port,  # type: ignore[attr-defined]
                backend=backend,
                config=config,
                model_path=model_path,
                eos_token_ids=frozenset(eos_token_ids),
                num_threads=torch.get_num_threads(),
                parent_pid=os.getpid(),
                relay_stop_signals=self._relay_stop_signals,
                collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                log_level=logging.getLogger().getEffectiveLevel(),
            )
            ours, theirs = context.Pipe()
            name = _process_name(rank, self.tp_size, self.pp_size)
            process = context.Process(target=worker_main, args=(args, theirs), name=name, daemon=False)
            process.start()
            theirs.close()
            self._add(_Worker(rank, process, ours, self._rank_name(rank)))
        # Registered after multiprocessing's own exit hook, so it runs first: that hook joins
        # non-daemonic children, which would wait forever for workers still waiting for steps. It holds
        # the list itself: the other nodes' ranks join it below.
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        atexit.register(self._finalizer)
        for worker in self._workers:
            self._expect(worker, "hello")
        if self._listener is not None:
            self._accept_remote_ranks(self._listener, config, backend)
            self._listener.close()
        for worker in self._workers:  # every rank is in: the process groups can form
            worker.conn.send("start")
        tp, pp = init_groups(
            0, self.tp_size, self.pp_size, self._store, backend, device, COLLECTIVE_TIMEOUT_S
        )
        self._has_group = True
        runner = ModelRunner(config, model_path, eos_token_ids, tp, self._agree_num_blocks, pp)
        if self.pp_size > 1:
            log_split(split_layers(runner.model_config.num_hidden_layers, self.pp_size))
        for worker in self._workers:
            self._expect(worker, "ready")
        nodes = ""
        if self.nnodes > 1:
            nodes = f", over {self.nnodes} nodes of {self.ranks_per_node} ranks"
        if self.pp_size == 1:
            logger.info(
                "tensor parallel over %d ranks (%s%s), rank 0 in process %d",
                self.size,
                backend,
                nodes,
                os.getpid(),
            )
        else:
            logger.info(
                "pipeline parallel over %d stages of %d tensor-parallel ranks (%s%s), rank 0 in process %d",
                self.pp_size,
                self.tp_size,
                backend,
                nodes,
                os.getpid(),
            )
        return runner

    def _start_store(self, config: EngineConfig) -> dist.TCPStore:
        """Rank 0's rendezvous store: on one node a free port of 127.0.0.1 (the store binds port 0
        itself, so no other process can take it meanwhile); over nodes --master-port on every interface
        (this process reaches it over the loopback, the other nodes at --master-addr)."""
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        if self.nnodes == 1:
            return dist.TCPStore("127.0.0.1", 0, self.size, True, timeout, wait_for_workers=False)
        try:
            return dist.TCPStore(
                "127.0.0.1", config.master_port, self.size, True, timeout, wait_for_workers=False
            )
        except RuntimeError as exc:  # DistNetworkError: the port is taken
            raise RuntimeError(
                f"rank 0 cannot listen on --master-port {config.master_port} for the other nodes: {exc}"
            ) from None

    def _rank_name(self, rank: int) -> str:
        stage, tp_rank = divmod(rank, self.tp_size)
        if self.pp_size == 1:
            name = f"tensor-parallel worker rank {rank}"
        else:
            name = f"worker rank {rank} (pipeline stage {stage}, tensor-parallel rank {tp_rank})"
        node = rank // self.ranks_per_node
        return name if node == 0 else f"{name} on node {node}"

    def _add(self, worker: _Worker) -> None:
        self._workers.append(worker)
        self._poller.register(worker.fd, select.POLLIN)

    def _accept_remote_ranks(self, listener: StepListener, config: EngineConfig, backend: str) -> None:
        """Wait for the ranks of nodes 1..N-1 to connect and say hello with this node's settings."""
        ours = config.rank_settings()

        def check(rank: int, hello: dict[str, Any]) -> str | None:
            if hello.get("backend") != backend:
                return (
                    f"its node runs {hello.get('backend')} collectives, the leader {backend}: every node "
                    "needs GPUs, or every node --device cpu"
                )
            return compare_settings(ours, hello.get("settings") or {})

        where = f"{config.master_addr}:{config.master_port}"
        conns = listener.accept_ranks(
            range(self.ranks_per_node, self.size), check, START_TIMEOUT_S, where, self.ranks_per_node
        )
        for rank in sorted(conns):
            self._add(_Worker(rank, None, conns[rank], self._rank_name(rank)))
        logger.info("ranks %d..%d of nodes 1..%d joined", self.ranks_per_node, self.size - 1, self.nnodes - 1)

    def _expect(self, worker: _Worker, kind: str) -> Any:
        """The worker's next start-up message, which must be `kind`; its traceback if it failed."""
        watched: list[Any] = (
            [worker.conn] if worker.process is None else [worker.conn, worker.process.sentinel]
        )
        if not wait(watched, START_TIMEOUT_S):
            raise RuntimeError(f"{worker.name} sent nothing in {START_TIMEOUT_S} s")
        if not worker.conn.poll():
            raise self._death(worker)
        try:
            got, value = heard(worker.conn)
        except (EOFError, OSError):
            raise self._death(worker) from None
        if got == "error":
            raise RuntimeError(f"{worker.name} failed to start:\n{value}")
        if got != kind:
            raise RuntimeError(f"{worker.name} sent {got!r}, expected {kind!r}")
        return value

    def _agree_num_blocks(self, num_blocks: int) -> int:
        """The smallest KV block count of all ranks (their free memory can differ). Agreed over the
        pipes, not a collective: a worker that failed to load is then reported with its traceback
        instead of leaving rank 0 in an NCCL all-reduce until it times out."""
        counts = [num_blocks] + [int(self._expect(w, "num_blocks")) for w in self._workers]
        agreed = min(counts)
        for worker in self._workers:
            worker.conn.send(agreed)
        logger.info("KV blocks per rank %s: all use %d", counts, agreed)
        return agreed

    # ---- steps ---------------------------------------------------------------------------------

    def execute(self, out: SchedulerOutput, grammar: GrammarBitmask | None = None) -> StepResult:
        return self.sample(self.forward(out), grammar).result()

    @property
    def can_overlap(self) -> bool:
        """Whether `forward` and `sample` return before the devices have run the step: on GPUs."""
        return self.runner.device.type == "cuda"

    def forward(self, out: SchedulerOutput, after: PendingResult | None = None) -> ForwardedStep:
        """Queue a step's forward pass on every rank without waiting for it. `after`: the step queued
        before, whose sampled tokens (rank 0 broadcasts them) are this step's inputs where the host has
        placeholders."""
        prev = after.step if isinstance(after, _WatchedStep) else after
        assert prev is None or isinstance(prev, PendingStep)
        if self.size == 1:
            return self.runner.launch_forward(out, prev)
        self.check_alive()
        step = self.runner.prepare(out, prev)
        message = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for worker in self._workers:
                worker.conn.send_bytes(message)
            logits = self.runner.forward(step, prev.sampled.tokens if prev and prev.sampled else None)
        except Exception as exc:
            raise self._step_failed(exc) from exc
        return ForwardedStep(out, step, logits)

    def sample(self, forwarded: ForwardedStep, grammar: GrammarBitmask | None = None) -> PendingResult:
        """Queue the sampling of a step whose forward pass is queued (rank 0 alone samples)."""
        if self.size == 1:
            return self.runner.sample(forwarded, grammar)
        try:
            if forwarded.step.prompt_chunks:  # finish reads prompt log-probabilities back: wait watching
                self._wait_for_device(self._record())
            pending = self.runner.finish(forwarded.out, forwarded.step, forwarded.logits, grammar)
        except Exception as exc:
            raise self._step_failed(exc) from exc
        return _WatchedStep(self, pending, self._record())

    def _record(self) -> torch.cuda.Event | None:
        """An event after the work queued so far (None on the CPU, where the work is done already)."""
        if self.runner.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _step_failed(self, exc: Exception) -> RuntimeError:
        dead = self._dead_worker(DEATH_GRACE_S)
        self._failure = str(dead) if dead else f"a step over {self.size} ranks failed on rank 0: {exc!r}"
        return RuntimeError(self._failure)

    def _wait_for_device(self, done: torch.cuda.Event | None) -> None:
        """Wait for `done`, watching the workers: a dead peer would hang it for ever."""
        while done is not None and not done.query():
            dead = self._dead_worker(0.0)
            if dead:
                raise dead

    def propose_drafts(self, reqs: list[Request], k: list[int]) -> list[list[int]]:
        """The draft model's drafts (rank 0 holds it; it has no collectives)."""
        return self.runner.propose_drafts(reqs, k)

    def add_lora(self, name: str, path: str) -> None:
        """Check a LoRA adapter on rank 0 (the other ranks read it when a step first places it)."""
        self.runner.add_lora(name, path)

    def check_alive(self) -> None:
        """Raise RuntimeError if a worker died (or a step failed, or the executor was shut down)."""
        if self._failure is not None:
            raise RuntimeError(self._failure)
        if self.size > 1 and self._is_stopped:
            raise RuntimeError("the tensor-parallel executor is shut down")
        dead = self._dead_worker(0.0)
        if dead:
            self._failure = str(dead)
            raise dead

    def _dead_worker(self, timeout_s: float) -> RuntimeError | None:
        ready = self._poller.poll(int(timeout_s * 1000))
        if not ready:
            return None
        fd = ready[0][0]
        return next(self._death(w) for w in self._workers if w.fd == fd)

    @staticmethod
    def _death(worker: _Worker) -> RuntimeError:
        """Why `worker` is gone: its exit code (or, from another node, its closed connection), and the
        traceback it sent last if it failed."""
        last = _last_words(worker.conn)
        if worker.process is None:
            if last is None:
                return RuntimeError(f"{worker.name} is gone: its connection to rank 0 closed")
            return RuntimeError(f"{worker.name} failed:\n{last}")
        worker.process.join(JOIN_TIMEOUT_S)
        died = f"{worker.name} died (exit code {worker.process.exitcode})"
        return RuntimeError(died if last is None else f"{died}:\n{last}")

    # ---- shutdown ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop and join the workers (killing those that do not stop in time). Idempotent."""
        if self._is_stopped:
            return
        self._is_stopped = True
        # Workers destroy their process group on stop, and NCCL's teardown wants every rank at it: tell
        # them first, tear rank 0's down alongside theirs, then join. (Joining first deadlocked on two
        # H200s: the worker waited in its teardown for rank 0, rank 0 in join for the worker.)
        _tell_workers_to_stop(self._workers)
        if self._listener is not None:
            self._listener.close()
        # With a failed NCCL step the communicator may be stuck: leave it to the process's exit.
        if self._has_group and (self._failure is None or dist.get_backend() == "gloo"):
            dist.destroy_process_group()
        if self._finalizer is not None:
            self._finalizer()
            atexit.unregister(self._finalizer)
        self._store = None


@dataclass
class _WatchedStep:
    """A tensor-parallel step in flight: waiting for it watches the workers, since a dead peer would
    leave rank 0 in a collective for ever."""

    executor: Executor
    step: PendingStep
    done: torch.cuda.Event | None  # recorded after the step's sampling

    def result(self) -> StepResult:
        try:
            self.executor._wait_for_device(self.done)
        except Exception as exc:
            raise self.executor._step_failed(exc) from exc
        return self.step.result()


def _process_name(rank: int, tp_size: int, pp_size: int) -> str:
    stage, tp_rank = divmod(rank, tp_size)
    return f"pagoda-tp-rank{rank}" if pp_size == 1 else f"pagoda-pp-stage{stage}-tp-rank{tp_rank}"


def _last_words(conn: Connection) -> str | None:
    """The traceback a failed worker sent before it went (None if it sent none)."""
    try:
        if conn.closed or not conn.poll():
            return None
        kind, value = heard(conn)
    except (EOFError, OSError, ValueError):
        return None
    return str(value) if kind == "error" else None


def _tell_workers_to_stop(workers: list[_Worker]) -> None:
    for worker in workers:
        if not worker.conn.closed:
            with contextlib.suppress(OSError):  # already gone
                worker.conn.send(None)


def _stop_workers(workers: list[_Worker]) -> None:
    _tell_workers_to_stop(workers)
    for worker in workers:
        if worker.process is not None:
            worker.process.join(JOIN_TIMEOUT_S)
            if worker.process.is_alive():
                logger.warning("%s did not stop; killing it", worker.name)
                worker.process.kill()
                worker.process.join()
        worker.conn.close()


def build_executor(config: EngineConfig, eos_token_ids: set[int], relay_stop_signals: bool = False) -> Any:
    """The model side of the core: every tensor-parallel rank, rank 0 in this process.
    `relay_stop_signals`: the workers relay SIGTERM and SIGINT to this process (the server's core)."""
    if config.executor_class is None:
        return Executor(config, config.model_path, eos_token_ids, relay_stop_signals)
    # Another model side, named explicitly (`--executor-class`): a benchmark's null model, a test double.
    module_name, _, class_name = config.executor_class.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"executor_class {config.executor_class!r} cannot be imported: {exc}") from exc
    return cls(config, eos_token_ids, relay_stop_signals)
