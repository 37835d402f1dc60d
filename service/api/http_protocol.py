"""uvicorn's httptools protocol with a bound on the request head (request line and headers).

httptools buffers a header of any length: a 16 MB header was answered 200 (measured), so one client
could make an API process hold gigabytes. uvicorn bounds the head only under h11
(`h11_max_incomplete_event_size`), whose pure-Python event handling would cost every streamed token.
Here, while a request's headers are incomplete, every byte received belongs to them; past the bound the
connection gets 431 and is closed.
"""

from __future__ import annotations

from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DEFAULT_MAX_HEADER_BYTES = 64 << 10  # nginx allows 4 x 8 KB, h11 16 KB: room for large bearer tokens


def bounded_head_protocol(max_header_bytes: int) -> type[HttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)`; 0 leaves the head unbounded."""

    class BoundedHeadProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_bytes = 0  # received since the last complete head, while none is complete
            self._in_head = True  # between requests or inside a head (no body is being read)
            self._events = 0  # heads and messages completed on this connection
            self._oversized = False

        def data_received(self, data: bytes) -> None:
            """A head still incomplete: every byte received since the last one ended is part of it."""
            events = self._events
            super().data_received(data)
            if self._events != events:  # a head or a body ended in `data`: those bytes were not all head
                self._head_bytes = 0
                return
            if not self._in_head or max_header_bytes <= 0 or self.transport.is_closing():
                return
            self._head_bytes += len(data)
            if self._head_bytes > max_header_bytes:
                self._refuse()

        def on_headers_complete(self) -> None:
            """A head that arrived whole in one read: measured as parsed."""
            self._in_head, self._events = False, self._events + 1
            size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
            if 0 < max_header_bytes < size:
                self._oversized = True
                raise httptools.HttpParserError("request head too large")  # uvicorn: send_400_response
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head, self._events = True, self._events + 1  # next: a head, if the connection is kept

        def send_400_response(self, msg: str) -> None:
            if self._oversized:
                self._refuse()
            else:
                super().send_400_response(msg)

        def _refuse(self) -> None:
            self.logger.warning("request head over %d bytes: 431", max_header_bytes)
            message = f"Request headers larger than {max_header_bytes} bytes (--max-header-bytes)."
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: text/plain; charset=utf-8\r\n"
                + f"content-length: {len(message)}\r\n".encode()
                + b"connection: close\r\n\r\n"
                + message.encode()
            )
            self.transport.close()

    return BoundedHeadProtocol
