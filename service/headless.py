"""A headless node: `pagoda serve --headless`, node K > 0 of `--nnodes` N. It serves no API, only its
ranks of the engine that node 0 (the leader) serves.

This process (no torch) spawns the node's ranks [K * R, (K + 1) * R) as worker processes
(`engine/runner/worker.py`): each waits for the leader's store at --master-addr:--master-port, connects
to rank 0 and runs the steps rank 0 sends (`engine/runner/nodes.py`). Rank r runs on this node's
cuda:(r - K * R). The process lives exactly as long as its ranks, and tells the pod's probes how they
are, on --host:--port:

- `/v1/health/live`: 200 while the ranks live (when one dies the process exits);
- `/v1/health/ready` and `/health`: 200 once every rank here has joined the group and loaded its shard,
  which is when the leader turns ready too; 503 before.

A rank that exits ends the node, since the group is broken: a rank here failed, or rank 0 went away (its
connection closed, a collective failed). The other ranks are killed and the process exits 1, or 0 when
rank 0 stopped the group in order (the leader shut down). SIGTERM or SIGINT (here, or relayed by a rank)
kills the ranks, which have nothing to save (the group is going down: a LeaderWorkerSet recreates it
whole), and exits 0. The ranks die with this process even when it is SIGKILLed (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.runner.nodes import heard
from pagoda.service.engine.runner.worker import COLLECTIVE_TIMEOUT_S, START_TIMEOUT_S, WorkerArgs, worker_main
from pagoda.service.stop_relay import RELAYED_STOP, STOP_SIGNALS

if TYPE_CHECKING:
    from pagoda.service.server import ServerConfig

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0  # ranks that rank 0 stopped: how long they get to exit before they are killed


@dataclass
class _Rank:
    rank: int
    process: BaseProcess
    conn: Connection | None  # its pipe to this process ("joined", "ready", "error"); None once closed
    state: str = "starting"  # then "joined", "ready"


class HeadlessNode:
    def __init__(self, server: ServerConfig, engine: EngineConfig) -> None:
        if engine.nnodes < 2 or engine.node_rank < 1:
            raise ValueError("a headless node is node 1..N-1 of --nnodes N > 1")
        self.server = server
        self.engine = engine
        first = engine.node_rank * engine.ranks_per_node
        self.ranks = range(first, first + engine.ranks_per_node)
        self._ranks: list[_Rank] = []
        self._is_stopping = False
        self._is_stopped_by_rank0 = False  # its ranks then exit by themselves
        self._wake_r, self._wake_w = os.pipe()

    @property
    def is_live(self) -> bool:
        return not self._is_stopping

    @property
    def is_ready(self) -> bool:
        return self.is_live and bool(self._ranks) and all(r.state == "ready" for r in self._ranks)

    def run(self) -> int:
        """Serve the health endpoint, run the ranks until one exits or a stop signal comes; the exit code."""
        # The kernel may hand a signal to any thread of the process (here the health server's), and
        # then Python runs the handler only once the main thread next runs bytecode: never, while it
        # waits in `_watch`. So the signal's number is written to the wake pipe by CPython's own C
        # handler, in whichever thread took it (`set_wakeup_fd`); the Python handler has nothing to do.
        os.set_blocking(self._wake_w, False)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in (*STOP_SIGNALS, RELAYED_STOP):
            signal.signal(sig, _ignore_here)
        try:
            http = _health_server(self.server.host, self.server.port, self)
        except OSError as exc:
            logger.error("cannot serve health on %s:%d: %s", self.server.host, self.server.port, exc)
            return 1
        threading.Thread(target=http.serve_forever, name="pagoda-health", daemon=True).start()
        engine = self.engine
        logger.info(
            "HTTP on %s:%d (health only: headless node %d of %d, ranks %d..%d, leader at %s:%d)",
            self.server.host,
            http.server_address[1],
            engine.node_rank,
            engine.nnodes,
            self.ranks.start,
            self.ranks.stop - 1,
            engine.master_addr,
            engine.master_port,
        )
        try:
            self._spawn()
            return self._watch()
        finally:
            self._stop_ranks()
            http.shutdown()
            http.server_close()

    def _spawn(self) -> None:
        """The node's ranks, from this (the main) thread: they die with it (PR_SET_PDEATHSIG)."""
        engine = self.engine
        context = mp.get_context("spawn")
        for rank in self.ranks:
            args = WorkerArgs(
                rank=rank,
                tp_size=engine.tensor_parallel_size,
                pp_size=engine.pipeline_parallel_size,
                store_host=str(engine.master_addr),
                store_port=engine.master_port,
                backend=None,  # the rank's own device: NCCL with GPUs, else gloo (rank 0 checks they agree)
                config=engine,
                model_path=engine.model_path,
                eos_token_ids=frozenset(),  # read only by the sampler, which runs on rank 0 alone
                num_threads=None,
                parent_pid=os.getpid(),
                relay_stop_signals=True,
                collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                log_level=logging.getLogger().getEffectiveLevel(),
                is_remote=True,
                start_timeout_s=START_TIMEOUT_S,
            )
            ours, theirs = context.Pipe()
            stage, tp_rank = divmod(rank, engine.tensor_parallel_size)
            name = f"pagoda-node{engine.node_rank}-pp-stage{stage}-tp-rank{tp_rank}"
            process = context.Process(target=worker_main, args=(args, theirs), name=name, daemon=False)
            process.start()
            theirs.close()
            self._ranks.append(_Rank(rank, process, ours))

    def _watch(self) -> int:
        """Until a rank exits (1, or 0 when rank 0 stopped the group) or a stop signal comes (0)."""
        sentinels = {r.process.sentinel: r for r in self._ranks}
        while True:
            conns = [r.conn for r in self._ranks if r.conn is not None]
            ready = wait([self._wake_r, *sentinels, *conns])
            if self._wake_r in ready:
                signum = os.read(self._wake_r, 1)[0]
                logger.info("%s: stopping the ranks", signal.Signals(signum).name)
                return 0
            for item in ready:
                if isinstance(item, Connection):
                    self._hear(next(r for r in self._ranks if r.conn is item))
            for fd in (fd for fd in ready if isinstance(fd, int) and fd in sentinels):
                rank = sentinels[fd]
                rank.process.join()
                code = rank.process.exitcode
                if code == 0:
                    logger.info("rank 0 stopped the group (the leader shut down): stopping")
                    self._is_stopped_by_rank0 = True
                    return 0
                logger.error("rank %d exited with code %s: the group is broken, stopping", rank.rank, code)
                return 1

    def _hear(self, rank: _Rank) -> None:
        assert rank.conn is not None
        try:
            kind, value = heard(rank.conn)
        except (EOFError, OSError, ValueError):
            rank.conn.close()  # its exit follows
            rank.conn = None
            return
        if kind == "error":
            logger.error("rank %d failed: %s", rank.rank, value)
        elif kind in ("joined", "ready"):
            rank.state = kind
            if self.is_ready:
                logger.info(
                    "ranks %d..%d joined the group and loaded: ready", self.ranks.start, self.ranks.stop - 1
                )

    def _stop_ranks(self) -> None:
        """Kill the ranks still running (those that rank 0 stopped get a moment to exit by themselves)."""
        self._is_stopping = True
        for rank in self._ranks:
            if self._is_stopped_by_rank0:
                rank.process.join(_JOIN_TIMEOUT_S)
            if rank.process.exitcode is None:
                rank.process.kill()
            rank.process.join()
            if rank.conn is not None:
                rank.conn.close()


class _HealthHandler(BaseHTTPRequestHandler):
    node: HeadlessNode  # set on the subclass `_health_server` makes

    def do_GET(self) -> None:  # http.server's name
        path = self.path.split("?", 1)[0]
        if path == "/v1/health/live":
            ok, status = self.node.is_live, "live" if self.node.is_live else "dead"
        elif path in ("/v1/health/ready", "/health"):
            ok = self.node.is_ready
            status = "ready" if ok else ("loading" if self.node.is_live else "unhealthy")
        else:
            self.send_error(404, "a headless node serves only /v1/health/live, /v1/health/ready and /health")
            return
        body = json.dumps({"status": status}).encode()
        self.send_response(200 if ok else 503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: not logged
        pass


def _health_server(host: str, port: int, node: HeadlessNode) -> ThreadingHTTPServer:
    handler = type("HealthHandler", (_HealthHandler,), {"node": node})
    server_class = type(
        "HealthServer",
        (ThreadingHTTPServer,),
        {"address_family": _family(host), "daemon_threads": True, "allow_reuse_address": True},
    )
    return server_class((host, port), handler)


def _family(host: str) -> int:
    import socket

    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _ignore_here(signum: int, frame: Any) -> None:
    """A stop signal's Python handler: the wake pipe already has its number (`HeadlessNode.run`)."""


def run_headless(server: ServerConfig, engine: EngineConfig) -> int:
    """`pagoda serve --headless`: this node's ranks until the group ends; the exit code."""
    return HeadlessNode(server, engine).run()
