"""The further API server processes of `pagoda serve --api-server-count N`.

One API process saturates near 17k tok/s of streamed output on an H200 (detokenizing, SSE and the
HTTP stack share one event loop and one GIL), below what the engine core steps. So, as vLLM's
`--api-server-count`, N processes serve HTTP and gRPC in front of one core:

- API process 0 is the one `pagoda serve` starts: it binds both ports, starts the core with one pair
  of sockets per API process (`CoreLink`) and, once its ports are known (`--port 0` resolved), spawns
  processes 1..N-1 through `ApiServerProcesses`. Each runs `serve()` as process 0 does, with an engine
  that attaches to the running core: on process 0's own HTTP listening socket (inherited, one accept
  queue: a process that dies leaves the connections waiting in it to the others) and on the same gRPC
  port (grpc sets SO_REUSEPORT itself; grpcio cannot adopt a socket). Process 0 turns ready once every
  other process is.
- Liveness, one rule: any process dying fails the server. The others die with process 0
  (PR_SET_PDEATHSIG); when the core or another process dies, process 0 kills the rest and answers 503
  to both probes, so Kubernetes restarts the pod. SIGTERM to process 0 goes on to the others, every
  process drains its own requests, and process 0 stops the core once they have all exited.
- /metrics: whichever process answers reports the whole server. Each process receives the core's
  stats every step (the engine gauges and counters); request counters and latency histograms go
  through prometheus_client's multiprocess mode: `pagoda serve` sets PROMETHEUS_MULTIPROC_DIR (a fresh
  folder, removed at exit) before prometheus_client is imported, each process writes its own files,
  and a scrape sums them. That is the library's own answer (no gauges of ours need a mode: the engine
  gauges are read from the stats at scrape time); forwarding observations to process 0 would add a
  socket and a message per token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable

import msgspec

from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.parent_death import die_with_parent
from pagoda.service.server import ServerConfig
from pagoda.service.stop_relay import RELAYED_STOP, relay_stop_signals

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Configs:
    server: ServerConfig  # with the resolved ports
    engine: EngineConfig


class ApiServerProcesses:
    """API process 0's handle on processes 1..N-1: start, readiness, exit watch, signals."""

    def __init__(self, server_config: ServerConfig, engine_config: EngineConfig, socket_dir: str) -> None:
        self.server_config = server_config
        self.engine_config = engine_config
        self.socket_dir = socket_dir
        self._procs: list[subprocess.Popen[bytes]] = []
        self._ready: list[asyncio.Future[bool]] = []
        self._stopping = False

    def start(self, http_socket: socket.socket, grpc_port: int, on_exit: Callable[[str], None]) -> None:
        """Spawn the processes on this listening socket and (resolved) gRPC port; `on_exit(message)` when
        one exits before `terminate` or `kill`. Call from the event loop's thread: they die with it."""
        loop = asyncio.get_running_loop()
        http_port = http_socket.getsockname()[1]
        config = dataclasses.replace(self.server_config, port=http_port, grpc_port=grpc_port)
        for index in range(1, self.server_config.api_server_count):
            read_fd, write_fd = os.pipe()
            command = [
                sys.executable,
                "-m",
                "pagoda.service.api_server_process",
                "--index",
                str(index),
                "--socket-dir",
                self.socket_dir,
                "--parent-pid",
                str(os.getpid()),
                "--ready-fd",
                str(write_fd),
                "--http-fd",
                str(http_socket.fileno()),
            ]
            env = {**os.environ, "PYTHONSAFEPATH": "1"}  # the repo's operator/ must not shadow the stdlib
            fds = (write_fd, http_socket.fileno())
            proc = subprocess.Popen(command, env=env, pass_fds=fds, stdin=subprocess.PIPE)
            os.close(write_fd)
            # On stdin, not the command line, where `ps` would show the API keys.
            assert proc.stdin is not None
            proc.stdin.write(msgspec.json.encode(_Configs(config, self.engine_config)))
            proc.stdin.close()
            ready: asyncio.Future[bool] = loop.create_future()
            self._procs.append(proc)
            self._ready.append(ready)
            threading.Thread(
                target=self._watch,
                args=(index, proc, read_fd, ready, loop, on_exit),
                name=f"pagoda-api-{index}-watch",
                daemon=True,
            ).start()

    def _watch(
        self,
        index: int,
        proc: subprocess.Popen[bytes],
        read_fd: int,
        ready: asyncio.Future[bool],
        loop: asyncio.AbstractEventLoop,
        on_exit: Callable[[str], None],
    ) -> None:
        is_ready = os.read(read_fd, 1) == b"1"  # b"": it exited (or closed the pipe) before ready
        os.close(read_fd)
        if is_ready:
            loop.call_soon_threadsafe(ready.set_result, True)
        code = proc.wait()

        def exited() -> None:
            if not ready.done():
                ready.set_result(False)
            if not self._stopping:
                on_exit(f"API server process {index} (pid {proc.pid}) exited with code {code}")

        with contextlib.suppress(RuntimeError):  # the loop has closed: the server is gone anyway
            loop.call_soon_threadsafe(exited)

    async def wait_ready(self) -> None:
        """Return once every process serves; RuntimeError if one exited first."""
        for index, ready in enumerate(self._ready, start=1):
            if not await ready:
                raise RuntimeError(f"API server process {index} exited while starting")

    def terminate(self) -> None:
        """Tell each to drain its own requests and exit (a second time: to abort them)."""
        self._signal(RELAYED_STOP)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: signal.Signals) -> None:
        self._stopping = True
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(sig)

    async def wait(self, timeout_s: float) -> None:
        """Wait for every process to exit; SIGKILL those left past `timeout_s`."""

        def wait_all() -> None:
            for proc in self._procs:
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    logger.warning(
                        "API server process %d did not exit in %.0f s: killing it", proc.pid, timeout_s
                    )
                    proc.kill()
                    proc.wait()

        await asyncio.to_thread(wait_all)


def main(argv: list[str] | None = None) -> int:
    """API process k > 0: `serve()` over an engine attached to process 0's core. Its configuration comes
    as JSON on stdin."""
    parser = argparse.ArgumentParser(prog="pagoda-api-server")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--socket-dir", required=True, help="the folder of the core's ipc sockets")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--ready-fd", type=int, required=True, help="write b'1' here once serving")
    parser.add_argument("--http-fd", type=int, required=True, help="process 0's HTTP listening socket")
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    # Process 0 says drain (and, a second time, abort) with RELAYED_STOP; a SIGTERM or SIGINT from
    # outside goes to process 0 (pagoda.service.stop_relay), which then tells every process.
    relay_stop_signals(args.parent_pid)
    configs = msgspec.json.decode(sys.stdin.buffer.read(), type=_Configs)
    server_config, engine_config = configs.server, configs.engine
    logging.basicConfig(
        level=server_config.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s [api {args.index}]: %(message)s",
        stream=sys.stderr,
    )
    from pagoda.service.engine.client.async_engine import AsyncEngine, CoreLink
    from pagoda.service.server import serve

    async def signal_ready() -> None:
        os.write(args.ready_fd, b"1")
        os.close(args.ready_fd)

    link = CoreLink(args.socket_dir, args.index, server_config.api_server_count)
    factory = functools.partial(AsyncEngine, log_level=server_config.log_level, link=link)
    return asyncio.run(
        serve(
            server_config,
            engine_config,
            factory,
            api_server_index=args.index,
            on_loaded=signal_ready,
            stop_signals=(RELAYED_STOP,),
            drain_signals=(),
            http_socket=socket.socket(fileno=args.http_fd),
        )
    )


if __name__ == "__main__":
    sys.exit(main())
