"""What every HTTP request passes before a route sees it: the API key, the body size limit and the body
read deadline. Pure ASGI middleware (no per-request task or body copy beyond the limit), answering in
OpenAI's error shape, or Anthropic's under /v1/messages."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.service.api.api_keys import APIKeys
from pagoda.service.api.messages_serving import error_body as messages_error_body

# Probes and scrapes never need a key: the kubelet and Prometheus do not hold one.
OPEN_PATHS = frozenset(
    {"/v1/health/live", "/v1/health/ready", "/health", "/get_load", "/metrics", "/version"}
)


def is_messages_path(path: str) -> bool:
    """Anthropic's Messages API: its clients read Anthropic's error shape and may send `x-api-key`."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


async def send_error(
    send: Send,
    scope: Scope,
    status: int,
    message: str,
    error_type: str,
    code: str,
    headers: dict[str, str] | None = None,
) -> None:
    error = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    if is_messages_path(scope["path"]):
        error = messages_error_body(status, message)
    body = json.dumps(error).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class APIKeyGuard:
    """401 unless `Authorization: Bearer <key>` holds one of `keys` (compared in constant time), or, on
    the Messages API's paths, `x-api-key: <key>` does: what Anthropic's clients send for `api_key`."""

    def __init__(self, app: ASGIApp, keys: Iterable[str]) -> None:
        self.app = app
        self.keys = APIKeys(keys)

    def authorized(self, headers: list[tuple[bytes, bytes]], path: str = "") -> bool:
        """Authorization decides when sent (Anthropic's `auth_token` is a bearer token too)."""
        first = {name: value for name, value in reversed(headers)}  # the first of each header
        if b"authorization" in first:
            return self.keys.accept(first[b"authorization"])
        if b"x-api-key" in first and is_messages_path(path):
            return self.keys.accept_key(first[b"x-api-key"].strip())
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] == "OPTIONS"  # CORS preflights carry no credentials
            or scope["path"] in OPEN_PATHS
            or self.authorized(scope["headers"], scope["path"])
        ):
            await self.app(scope, receive, send)
            return
        await send_error(
            send,
            scope,
            401,
            "Incorrect or missing API key: send it as `Authorization: Bearer <key>`"
            + (" or `x-api-key: <key>`." if is_messages_path(scope["path"]) else "."),
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

    def _too_large(self, send: Send, scope: Scope, size: str) -> Any:
        return send_error(
            send,
            scope,
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
                await self._too_large(send, scope, f"{int(value)} bytes")
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
                    scope,
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
                await self._too_large(send, scope, f"more than {self.max_bytes} bytes")
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
