"""The serving process: the engine client, uvicorn (HTTP) and grpc.aio in one event loop, and the
shutdown sequence.

Start-up: both servers listen first (liveness answers at once, readiness says "loading"), then the
model loads in a worker thread; readiness and the gRPC health service flip to serving after it.
SIGTERM/SIGINT: readiness flips to not-ready and new requests get 503/UNAVAILABLE, in-flight requests
finish (up to the drain timeout or a second signal, then they are aborted), the servers close, the
process exits 0.

With `--api-server-count N` this runs in N processes on the same ports (`api_server_process`): process
0 spawns the others once its ports are known, waits for them before it is ready, forwards SIGTERM to
them and stops the engine core only after they have drained and exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import uvicorn

from pagoda.service.api.engine_client import EngineClient, ServingState
from pagoda.service.api.grpc_server import GrpcServer
from pagoda.service.api.http_protocol import DEFAULT_MAX_HEADER_BYTES, bounded_head_protocol
from pagoda.service.api.http_server import DEFAULT_BODY_READ_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES, build_app
from pagoda.service.engine.config import DEFAULT_STALL_TIMEOUT_S
from pagoda.service.stop_relay import RELAYED_STOP, STACK_DUMP_SIGNAL, STOP_SIGNALS

if TYPE_CHECKING:
    from pagoda.service.api_server_process import ApiServerProcesses

logger = logging.getLogger(__name__)


_CLOSE_GRACE_S = 2  # seconds
# How long an idle HTTP connection stays open. uvicorn's timer starts when the server has written a
# response; a client that reuses the connection as it fires, while the server's loop is busy, gets a
# reset before any byte (httpx `ReadError`: reproduced with a uvicorn loop blocked 20 ms at a time,
# 13 of 400 reuses within 20 ms of the timeout). Most likely the ~1 in 2000 such errors of `pagoda bench
# serve` at 256 in flight against the null model at uvicorn's 5 s: the server writes a whole response
# at once and the saturated client reads it seconds later. 65 s outlasts the clients' own idle limits
# (httpx 5 s, a cloud load balancer's 60 s), so they close first; an idle connection costs a socket.
_KEEP_ALIVE_S = 65


# With several API processes: which one answered an HTTP request (a header, never in a response body).
API_SERVER_HEADER = "x-pagoda-api-server"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    grpc_port: int = 8001
    max_waiting_requests: int = 1024  # 0: no limit
    drain_timeout_s: float = 30.0
    engine_stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S  # 0: never
    log_level: str = "info"
    api_keys: tuple[str, ...] = ()  # none: no authentication
    allowed_origins: tuple[str, ...] = ()  # CORS; none: no CORS headers
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    tool_call_parser: str = "auto"  # tool_calls.PARSERS
    api_server_count: int = 1  # processes serving HTTP and gRPC in front of one engine core
    headless: bool = False  # a node of a multi-node engine other than 0: its ranks and /health only


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: this process drains before uvicorn is told to exit."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    """The HTTP listening socket. With several API processes, process 0 makes it and the others inherit
    it (as vLLM and uvicorn's own workers do): one accept queue, so a connection waiting in it is
    taken by whichever process lives. SO_REUSEPORT gave each process its own queue, and the
    connections queued at a process that died were reset."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this. Without it the first SSE chunk after the response headers
    # waits for the client's delayed ACK (40 ms on Linux): measured 48 ms instead of 4 ms to first token.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def serve(
    server_config: ServerConfig,
    engine_config: Any,
    engine_factory: Callable[[Any], Any],
    install_signal_handlers: bool = True,
    stop_event: asyncio.Event | None = None,
    api_server_index: int = 0,
    api_servers: ApiServerProcesses | None = None,
    on_loaded: Callable[[], Awaitable[None]] | None = None,
    stop_signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
    drain_signals: tuple[signal.Signals, ...] = (RELAYED_STOP,),
    http_socket: socket.socket | None = None,
) -> int:
    """Run until SIGTERM/SIGINT (or `stop_event`); return the exit code. `api_servers`: process 0's
    further API server processes, started once the ports are known; `on_loaded`: awaited after the
    engine started, before this process turns ready; `stop_signals`: what starts the drain (a second one
    aborts what is left); `drain_signals`: what starts it and is never taken for a second signal (a
    child's relayed stop: pagoda.service.stop_relay); `http_socket`: the listening socket process 0
    made (processes 1..N-1)."""
    stop = stop_event or asyncio.Event()
    is_multi = server_config.api_server_count > 1
    client = EngineClient(
        engine_config,
        engine_factory,
        server_config.max_waiting_requests,
        tool_call_parser=server_config.tool_call_parser,
        stall_timeout_s=server_config.engine_stall_timeout_s,
    )
    sock = http_socket or _bind(server_config.host, server_config.port)
    http = _Uvicorn(
        uvicorn.Config(
            build_app(
                client,
                server_config.api_keys,
                server_config.allowed_origins,
                server_config.max_request_bytes,
                server_config.body_read_timeout_s,
            ),
            http=bounded_head_protocol(server_config.max_header_bytes),
            lifespan="off",
            log_level=server_config.log_level,
            access_log=False,
            timeout_keep_alive=_KEEP_ALIVE_S,
            # Only requests still open after the drain (timed out, or a second signal) are left by
            # then: their handlers are cancelled, which aborts them in the engine.
            timeout_graceful_shutdown=_CLOSE_GRACE_S,
            headers=[(API_SERVER_HEADER, str(api_server_index))] if is_multi else None,
        )
    )
    grpc_server = GrpcServer(client, server_config.host, server_config.grpc_port, server_config.api_keys)
    await grpc_server.start()
    http_task = asyncio.create_task(http.serve(sockets=[sock]))
    logger.info(
        "HTTP on %s:%d, gRPC on %s:%d",
        server_config.host,
        sock.getsockname()[1],
        server_config.host,
        grpc_server.port,
    )
    loop = asyncio.get_running_loop()
    if install_signal_handlers:
        for sig in (*stop_signals, *drain_signals):
            loop.add_signal_handler(sig, stop.set)
    # (before any child exists: a child's relayed stop must never meet the default action)
    if api_servers is not None:
        api_servers.start(sock, grpc_server.port, on_exit=client.fail)
        on_loaded = api_servers.wait_ready

    exit_code = 0
    load_task = asyncio.create_task(client.load(on_loaded))
    on_unhealthy = api_servers.kill if api_servers is not None else None
    watch_task = asyncio.create_task(_watch_health(client, grpc_server, on_unhealthy))
    stop_task = asyncio.create_task(stop.wait())
    await asyncio.wait({load_task, stop_task, http_task}, return_when=asyncio.FIRST_COMPLETED)
    if load_task.done() and load_task.exception() is not None:
        logger.error("model load failed: %s", load_task.exception())
        exit_code = 1
    elif not stop.is_set() and not http_task.done():
        await asyncio.wait({stop_task, http_task}, return_when=asyncio.FIRST_COMPLETED)
    if http_task.done() and not stop.is_set():
        logger.error("the HTTP server stopped unexpectedly")
        exit_code = 1

    if exit_code == 0 and client.state is ServingState.UNHEALTHY:
        # Stopped after the engine died (a crashed core or worker): not a clean exit, say so.
        logger.error("stopping with the engine failed")
        exit_code = 1
    # Drain: not-ready first, then let in-flight requests finish; a second signal aborts them.
    logger.info("shutting down: draining %d in-flight requests", client.num_in_flight)
    force = asyncio.Event()
    if install_signal_handlers:
        for sig in stop_signals:
            loop.add_signal_handler(sig, functools.partial(_force, force, api_servers))
        for sig in drain_signals:
            loop.add_signal_handler(sig, lambda: None)  # already draining
    if api_servers is not None:
        if exit_code == 0 and load_task.done():
            api_servers.terminate()  # each drains its own requests
        else:
            api_servers.kill()
    client.start_drain()
    await grpc_server.set_serving(False)
    if load_task.done() and exit_code == 0:
        drained = await client.wait_idle(server_config.drain_timeout_s, force)
        logger.info("drain %s", "complete" if drained else "timed out; the rest were aborted")
    else:
        load_task.cancel()
    watch_task.cancel()
    stop_task.cancel()
    http.should_exit = True
    await asyncio.gather(http_task, return_exceptions=True)
    await grpc_server.stop(grace_s=_CLOSE_GRACE_S)
    if api_servers is not None:  # the core serves them until they have exited
        await api_servers.wait(server_config.drain_timeout_s + 4 * _CLOSE_GRACE_S)
    await client.shutdown()
    if install_signal_handlers:
        for sig in stop_signals:
            loop.remove_signal_handler(sig)
        for sig in drain_signals:
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)  # a late relay must not end this process by default
    return exit_code


def _force(force: asyncio.Event, api_servers: ApiServerProcesses | None) -> None:
    """A second signal: abort in-flight requests here and in the other API processes."""
    force.set()
    if api_servers is not None:
        api_servers.terminate()


def _report_stall(client: EngineClient) -> None:
    """Say that the engine stalled, and where: the core (if this process started it) prints every
    thread's stack to the log on STACK_DUMP_SIGNAL (faulthandler: even from inside C code; a stopped
    core prints it once continued)."""
    core_pid = client.engine.pid
    logger.error(
        "the engine core made no step for %.0f s with %d requests pending (stall timeout %.0f s): "
        "liveness and readiness fail%s",
        client.stalled_for,
        client.num_in_flight,
        client.stall_timeout_s,
        f"; the core's stacks follow (pid {core_pid})" if core_pid is not None else "",
    )
    if core_pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(core_pid, STACK_DUMP_SIGNAL)


async def _watch_health(
    client: EngineClient, grpc_server: GrpcServer, on_unhealthy: Callable[[], None] | None = None
) -> None:
    """Mirror the client's state into grpc.health.v1 (SERVING only when ready); call `on_unhealthy`
    once the client turns unhealthy (process 0 then kills the other API processes)."""
    was_ready: bool | None = None
    was_stalled = False
    while True:
        state = client.state
        is_ready = state is ServingState.READY
        if is_ready != was_ready:
            await grpc_server.set_serving(is_ready)
            was_ready = is_ready
        if (state is ServingState.STALLED) != was_stalled:
            was_stalled = not was_stalled
            if was_stalled:
                _report_stall(client)
            else:
                logger.warning("the engine core steps again")
        if state is ServingState.UNHEALTHY and on_unhealthy is not None:
            on_unhealthy()
            on_unhealthy = None
        # Explicit transitions wake us at once; the poll catches an engine that died on its own.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(client.state_changed.wait(), timeout=0.2)
        client.state_changed.clear()
