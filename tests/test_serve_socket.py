"""The HTTP listening socket: small writes (SSE chunks) go out at once."""

from __future__ import annotations

import socket

from pagoda.service.server import _bind


def test_connections_have_nagle_off() -> None:
    listener = _bind("127.0.0.1", 0)
    with listener, socket.create_connection(listener.getsockname()[:2]) as client:
        accepted, _ = listener.accept()
        with accepted:
            # The first streamed token must not wait for the client's delayed ACK of the headers.
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert client.fileno() >= 0
