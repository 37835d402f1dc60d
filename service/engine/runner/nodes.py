"""Ranks on other nodes: how they find rank 0, and the connections that carry their steps.

One engine's P x T ranks may span N nodes (`EngineConfig.nnodes`): node k runs global ranks
[k * R, (k + 1) * R), R = P x T / N. Node 0, the leader, runs rank 0 in its engine core and its other
ranks as local workers over pipes (`executor.py`). Every other node is `pagoda serve --headless`
(`service/headless.py`), whose ranks are worker processes that reach rank 0 by themselves:

1. each waits until the leader's store answers at --master-addr:--master-port (the leader may start
   minutes later than its workers: a cold image pull), joins it, and reads there the port of rank 0's
   step listener (any free port: --master-port is the only port fixed in advance);
2. it opens one TCP connection to rank 0 and says hello: its rank and the settings every node's ranks
   must share (`EngineConfig.rank_settings`); rank 0 refuses a mismatch, naming the settings;
3. rank 0 answers "start" once every rank of every node has said hello, so no rank waits in
   torch.distributed's 60 s rendezvous for a node that is still starting; from there on the connection
   is a worker's pipe: the KV block agreement, "ready", then each step's pickled `StepInput`.

What goes up to rank 0 (hello, block counts, ready, a traceback) is JSON, so rank 0 never unpickles
what arrives on a socket; what comes down is pickled, as on the pipes, and a worker trusts the leader it
connected to as it trusts its store. Neither the store nor gloo nor NCCL authenticates its peers: the
network between a group's pods must be trusted (a NetworkPolicy around the group).

Failure: TCP keep-alive probes a silent connection (a node that vanished without closing it) and
TCP_USER_TIMEOUT bounds a send to a peer that stopped acknowledging, so either side learns of the
other's loss within `DEAD_PEER_S` even while idle; a closed connection is seen at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

logger = logging.getLogger(__name__)

STEP_PORT_KEY = "pagoda/step_port"  # in rank 0's store: the port of its step listener
_KEEPALIVE_IDLE_S, _KEEPALIVE_INTERVAL_S, _KEEPALIVE_COUNT = 5, 2, 5
DEAD_PEER_S = _KEEPALIVE_IDLE_S + _KEEPALIVE_INTERVAL_S * _KEEPALIVE_COUNT  # 15 s
_PROGRESS_S = 30.0  # how often a long wait says what it waits for


def tell(conn: Connection, kind: str, value: Any = None) -> None:
    """A message to rank 0 (hello, num_blocks, ready, error): JSON, never pickle."""
    conn.send_bytes(json.dumps([kind, value]).encode())


def heard(conn: Connection) -> tuple[str, Any]:
    """The next message `tell` sent on `conn` (EOFError when it closed, ValueError when it is not one)."""
    kind, value = json.loads(conn.recv_bytes(1 << 20))
    return str(kind), value


def _tune(sock: socket.socket, send_timeout_s: float | None = None) -> Connection:
    """A connected TCP socket as a multiprocessing Connection (the pipes' framing and calls), with
    Nagle off (a step goes out as a header and a body: Nagle would hold the body for the header's
    ACK, 40 ms) and dead peers detected (see the module's docstring). `send_timeout_s`: a send that
    cannot proceed for that long fails instead of blocking (rank 0's sends to a hung node)."""
    sock.settimeout(None)  # blocking: the Connection reads and writes the descriptor directly
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, _KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, _KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, _KEEPALIVE_COUNT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, DEAD_PEER_S * 1000)
    if send_timeout_s is not None:
        seconds = int(send_timeout_s)
        timeval = struct.pack("ll", seconds, int((send_timeout_s - seconds) * 1e6))  # struct timeval
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    return Connection(sock.detach())


def wait_for_leader(host: str, port: int, timeout_s: float, what: str) -> None:
    """Return once something accepts connections at host:port; TimeoutError after `timeout_s`. Plain
    connects, once a second: torch's store client retries with a growing back-off and logs each try."""
    deadline = started = time.monotonic()
    deadline += timeout_s
    said = started
    while True:
        try:
            socket.create_connection((host, port), timeout=2.0).close()
            return
        except OSError as exc:
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(
                    f"{what}: the leader's store at {host}:{port} did not answer in {timeout_s:.0f} s ({exc})"
                ) from None
            if now - said >= _PROGRESS_S:
                logger.info(
                    "%s: waiting for the leader at %s:%d (%.0f s): %s", what, host, port, now - started, exc
                )
                said = now
            time.sleep(1.0)


def connect(host: str, port: int) -> Connection:
    """A worker's connection to rank 0's step listener."""
    return _tune(socket.create_connection((host, port), timeout=30.0))


class StepListener:
    """Rank 0's side: a listening socket on every interface (any free port, published in the store)
    where the ranks of the other nodes connect and say hello."""

    def __init__(self, send_timeout_s: float) -> None:
        if socket.has_dualstack_ipv6():
            self._sock = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            self._sock = socket.create_server(("", 0))
        self.port: int = self._sock.getsockname()[1]
        self._send_timeout_s = send_timeout_s

    def close(self) -> None:
        self._sock.close()

    def accept_ranks(
        self,
        ranks: range,
        check_hello: Callable[[int, dict[str, Any]], str | None],
        timeout_s: float,
        where: str,
        ranks_per_node: int,
    ) -> dict[int, Connection]:
        """A connection from each of `ranks` that said hello. `check_hello(rank, hello)`: why that hello
        is refused, or None. A refused hello, or a rank missing past `timeout_s`, raises RuntimeError
        (the refused peer is told why first)."""
        joined: dict[int, Connection] = {}
        pending: list[Connection] = []
        started = said = time.monotonic()
        logger.info(
            "waiting for ranks %d..%d of the other nodes to join at %s", ranks.start, ranks.stop - 1, where
        )
        try:
            while len(joined) < len(ranks):
                now = time.monotonic()
                missing = [r for r in ranks if r not in joined]
                if now - started >= timeout_s:
                    raise RuntimeError(
                        f"ranks {missing} (of the other nodes) did not join at {where} in {timeout_s:.0f} s"
                    )
                if now - said >= _PROGRESS_S:
                    waited = now - started
                    logger.info("still waiting for ranks %s to join at %s (%.0f s)", missing, where, waited)
                    said = now
                for ready in wait([self._sock, *pending], timeout=1.0):
                    if ready is self._sock:
                        sock, _ = self._sock.accept()
                        pending.append(_tune(sock, self._send_timeout_s))
                        continue
                    assert isinstance(ready, Connection)
                    pending.remove(ready)
                    rank = self._hello(ready, ranks, joined, check_hello, ranks_per_node)
                    if rank is not None:
                        joined[rank] = ready
        except BaseException:
            for conn in [*pending, *joined.values()]:
                conn.close()
            raise
        finally:
            for conn in pending:
                conn.close()
        return joined

    @staticmethod
    def _hello(
        conn: Connection,
        ranks: range,
        joined: dict[int, Connection],
        check_hello: Callable[[int, dict[str, Any]], str | None],
        ranks_per_node: int,
    ) -> int | None:
        """The rank that `conn` says hello for; None (and `conn` closed) for a connection that closed
        or sent something else; RuntimeError for a hello refused."""
        try:
            kind, hello = heard(conn)
            if kind == "error":  # a rank that failed before its hello (its GPUs): its traceback
                conn.close()
                raise RuntimeError(f"a rank of another node failed to start:\n{hello}")
            rank = int(hello["rank"])
        except (EOFError, OSError, ValueError, TypeError, KeyError) as exc:
            logger.warning("a connection to the step listener sent no hello (%r): closed", exc)
            conn.close()
            return None
        if kind != "hello":
            why: str | None = f"sent {kind!r} first, expected a hello"
        elif rank in joined:
            why = f"rank {rank} joined already: do two nodes run --node-rank {rank // ranks_per_node}?"
        elif rank not in ranks:
            why = (
                f"the other nodes run ranks {ranks.start}..{ranks.stop - 1}: was its node started with other "
                "--nnodes or parallel sizes?"
            )
        else:
            why = check_hello(rank, hello)
        if why is None:
            return rank
        with contextlib.suppress(OSError):
            conn.send(("refused", why))
        conn.close()
        raise RuntimeError(f"rank {rank} (node {rank // ranks_per_node}) refused: {why}")


def compare_settings(ours: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """What differs between two nodes' `rank_settings`, in words; None when nothing does."""
    differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if not differ:
        return None
    listed = "; ".join(f"{k}: {theirs.get(k)!r} there, {ours.get(k)!r} here" for k in differ)
    return (
        f"it was started with other settings than the leader ({listed}); every node runs the same "
        "pagoda serve flags but --node-rank and --headless"
    )
