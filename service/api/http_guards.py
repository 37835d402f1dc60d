"""What every HTTP request passes before a route sees it: the API key, the body size limit and the body
read deadline. Pure ASGI middleware (no per-request task or body copy beyond the limit), answering in
OpenAI's error shape."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.service.api.api_keys import APIKeys

# Probes and scrapes never need a key: the kubelet and Prometheus do not hold one.
OPEN_PATHS = frozenset(
    {"/v1/health/live", "/v1/health/ready", "/health", "/get_load", "/metrics", "/version"}
)


async def send_error(
    send: Send, status: int, message: str, error_type: str, code: str, headers: dict[str, str] | None = None
) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    ).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class APIKeyGuard:
    """401 unless `Authorization: Bearer <key>` holds one of `keys` (compared in constant time)."""

    def __init__(self, app: ASGIApp, keys: Iterable[str]) -> None:
        self.app = app
        self.keys = APIKeys(keys)

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        for name, value in headers:
            if name == b"authorization":
                return self.keys.accept(value)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] == "OPTIONS"  # CORS preflights carry no credentials
            or scope["path"] in OPEN_PATHS
            or self.authorized(scope["headers"])
        ):
            await self.app(scope, receive, send)
            return
        await send_error(
            send,
            401,
            "Incorrect or missing API key: send it as `Authorization: Bearer <key>`.",
            "invalid_request_error",
            "invalid_api_key",
            {"www-authenticate": "Bearer"},
        )


class BodyLimit:
    """413 for a request body over `max_bytes`, by its Content-Length before reading anything, or as
    soon as a chunked body passes the limit; 408 for a body not whole within `timeout_s` of the request
    (a client trickling it would hold the connection and its buffer for ever). Nothing of a refused
    body reaches the route; 0 turns either limit off."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = 0.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    def _too_large(self, send: Send, size: str) -> Any:
        return send_error(
            send,
            413,
            f"The request body ({size}) is larger than this server accepts ({self.max_bytes} bytes, "
            "--max-request-bytes).",
            "invalid_request_error",
            "request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (self.max_bytes <= 0 and self.timeout_s <= 0):
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and 0 < self.max_bytes < int(value):
                await self._too_large(send, f"{int(value)} bytes")
                return
        # Read the body here (it is bounded), then hand it to the route as one message.
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                async with asyncio.timeout_at(deadline if self.timeout_s > 0 else None):
                    message = await receive()
            except TimeoutError:
                await send_error(
                    send,
                    408,
                    f"The request body did not arrive within {self.timeout_s:g} s (--body-read-timeout).",
                    "invalid_request_error",
                    "request_timeout",
                    {"connection": "close"},
                )
                return
            if message["type"] != "http.request":
                break  # the client left: let the route see the disconnect
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if 0 < self.max_bytes < size:
                await self._too_large(send, f"more than {self.max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                if message["type"] != "http.request":
                    return message
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
