"""The API-key check of both transports, on its own: HTTP's `APIKeyGuard` (ASGI middleware) and gRPC's
`APIKeyInterceptor` must accept exactly `Bearer <one of the keys>`, and nothing near it: a prefix of
the key, the key with more after it, an empty token, another scheme. The servers' own tests
(test_serve_http, test_serve_grpc) check the same guards in place with real clients."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pagoda.service.api.grpc_server import APIKeyInterceptor
from pagoda.service.api.http_guards import APIKeyGuard, BodyLimit

KEYS = ("secret-key", "second-key")
CASES = [
    ("Bearer secret-key", True),
    ("bearer secret-key", True),  # the scheme is case-insensitive (RFC 7235)
    ("BEARER second-key", True),  # any of the keys
    ("Bearer secret-key ", True),  # surrounding blanks are not part of the token
    ("Bearer secret", False),  # a prefix of the key
    ("Bearer secret-key2", False),  # the key and more
    ("Bearer SECRET-KEY", False),  # keys are case-sensitive
    ("Bearer ", False),
    ("Bearer", False),
    ("", False),
    ("secret-key", False),  # no scheme
    ("Basic secret-key", False),
    ("Token secret-key", False),
    ("Bearersecret-key", False),
    ("Bearer secret-key second-key", False),
]


@pytest.mark.parametrize(("value", "expected"), CASES)
def test_http_and_grpc_accept_exactly_bearer_and_a_key(value: str, expected: bool) -> None:
    http = APIKeyGuard(app=None, keys=KEYS)  # type: ignore[arg-type]
    assert http.authorized([(b"authorization", value.encode())]) is expected
    grpc = APIKeyInterceptor(KEYS)
    assert grpc.authorized([("authorization", value)]) is expected
    assert grpc.authorized([("authorization", value.encode())]) is expected


def test_no_authorization_header_or_the_key_elsewhere_is_refused() -> None:
    http = APIKeyGuard(app=None, keys=KEYS)  # type: ignore[arg-type]
    grpc = APIKeyInterceptor(KEYS)
    assert not http.authorized([])
    assert not http.authorized([(b"x-api-key", b"secret-key"), (b"cookie", b"Bearer secret-key")])
    assert not grpc.authorized(None)
    assert not grpc.authorized([("x-api-key", "secret-key")])


@pytest.mark.parametrize(
    ("path", "header", "expected"),
    [
        ("/v1/messages", b"secret-key", True),  # Anthropic's clients send `api_key` as x-api-key
        ("/v1/messages/count_tokens", b"second-key", True),
        ("/v1/messages", b" secret-key ", True),
        ("/v1/messages", b"secret", False),
        ("/v1/messages", b"secret-key2", False),
        ("/v1/messages", b"Bearer secret-key", False),  # x-api-key holds the key bare
        ("/v1/messages", b"", False),
        ("/v1/messagesx", b"secret-key", False),  # only the Messages API's own paths
        ("/v1/chat/completions", b"secret-key", False),
        ("/", b"secret-key", False),
    ],
)
def test_x_api_key_is_read_on_the_messages_paths_only(path: str, header: bytes, expected: bool) -> None:
    http = APIKeyGuard(app=None, keys=KEYS)  # type: ignore[arg-type]
    assert http.authorized([(b"x-api-key", header)], path) is expected
    # Authorization, when sent, decides: Anthropic's auth_token travels as a bearer token.
    assert http.authorized([(b"authorization", b"Bearer second-key"), (b"x-api-key", b"no")], path)
    assert not http.authorized([(b"x-api-key", header), (b"authorization", b"Bearer no")], path)


@pytest.fixture(scope="module")
def client() -> TestClient:
    async def hello(request: Request) -> PlainTextResponse:
        return PlainTextResponse("hello")

    paths = ["/v1/models", "/v1/messages", "/v1/health/live", "/v1/health/ready", "/metrics", "/version"]
    app = Starlette(routes=[Route(p, hello, methods=["GET", "POST", "PUT", "OPTIONS"]) for p in paths])
    return TestClient(APIKeyGuard(app, KEYS))


def test_http_guard_answers_401_in_openai_shape_and_leaves_probes_open(client: TestClient) -> None:
    refused = client.get("/v1/models", headers={"Authorization": "Bearer secret"})
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"] == "Bearer"
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer second-key"}).text == "hello"
    for path in ("/v1/health/live", "/v1/health/ready", "/metrics", "/version"):
        assert client.get(path).status_code == 200, path  # the kubelet and Prometheus hold no key
    assert client.get("/v1/health/live/../../v1/models").status_code == 401
    assert client.options("/v1/models").status_code == 200  # CORS preflights carry no credentials
    for method in ("POST", "PUT"):  # methods that sort after OPTIONS are no preflight
        assert client.request(method, "/v1/models").status_code == 401, method


def test_http_guard_answers_the_messages_api_in_anthropic_shape(client: TestClient) -> None:
    refused = client.post("/v1/messages", headers={"x-api-key": "secret"})
    assert refused.status_code == 401
    assert refused.json() == {
        "type": "error",
        "error": {
            "type": "authentication_error",
            "message": "Incorrect or missing API key: send it as `Authorization: Bearer <key>` or "
            "`x-api-key: <key>`.",
        },
    }
    assert client.post("/v1/messages", headers={"x-api-key": "second-key"}).text == "hello"
    assert client.get("/v1/models", headers={"x-api-key": "second-key"}).status_code == 401


LIMIT = 64


@pytest.fixture(scope="module")
def echo() -> TestClient:
    async def echo_body(request: Request) -> PlainTextResponse:
        body = await request.body()
        return PlainTextResponse(f"{len(body)}:{body[:8].decode()}")

    app = Starlette(routes=[Route("/v1/completions", echo_body, methods=["POST"])])
    return TestClient(BodyLimit(app, LIMIT))


def _chunks(*sizes: int) -> Iterator[bytes]:
    """A body without Content-Length (chunked transfer): only the bytes read so far are known."""
    for i, size in enumerate(sizes):
        yield bytes([ord("a") + i]) * size


def test_body_limit_by_content_length_and_while_reading_a_chunked_body(echo: TestClient) -> None:
    url = "/v1/completions"
    assert echo.post(url, content=b"x" * LIMIT).text == f"{LIMIT}:xxxxxxxx"  # the limit itself passes
    too_large = echo.post(url, content=b"x" * (LIMIT + 1))
    assert too_large.status_code == 413
    assert too_large.json()["error"]["code"] == "request_too_large"
    assert f"{LIMIT + 1} bytes" in too_large.json()["error"]["message"]
    assert echo.post(url, content=_chunks(30, 34)).text == "64:aaaaaaaa"  # the route gets every chunk
    chunked = echo.post(url, content=_chunks(30, 30, 5))
    assert chunked.status_code == 413
    assert f"more than {LIMIT} bytes" in chunked.json()["error"]["message"]
    assert echo.post(url, content=b"").text == "0:"


def test_no_body_limit_when_it_is_zero() -> None:
    async def size(request: Request) -> PlainTextResponse:
        return PlainTextResponse(str(len(await request.body())))

    app = Starlette(routes=[Route("/", size, methods=["POST"])])
    assert TestClient(BodyLimit(app, 0)).post("/", content=b"y" * 10_000).text == "10000"


async def _body_under_deadline(
    chunks: list[tuple[float, bytes | None]],
    timeout_s: float,
    max_bytes: int = 0,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> list[dict[str, Any]]:
    """What BodyLimit sends for a body arriving as (delay before it, bytes) chunks; the bytes `None`: the
    client disconnects there."""
    sent: list[dict[str, Any]] = []
    pending = list(chunks)

    async def receive() -> dict[str, Any]:
        delay, body = pending.pop(0)
        await asyncio.sleep(delay)
        if body is None:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": body, "more_body": bool(pending)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                await send({"type": "app.saw", "disconnect": True})
                return
            body, more = body + message["body"], message["more_body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(len(body)).encode()})

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers or []}
    await BodyLimit(app, max_bytes, timeout_s)(scope, receive, send)
    return sent


def test_a_body_not_whole_by_the_deadline_is_408() -> None:
    """The deadline is for the whole body, not for each chunk: a trickle of quick chunks is refused too."""
    trickle = [(0.02, b"x")] * 20 + [(0.0, b"end")]
    sent = asyncio.run(_body_under_deadline(trickle, timeout_s=0.1))
    assert sent[0]["status"] == 408 and (b"connection", b"close") in sent[0]["headers"]
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == "request_timeout" and "0.1 s" in error["message"]
    on_time = asyncio.run(_body_under_deadline([(0.0, b"ab"), (0.0, b"cd")], timeout_s=5))
    assert [m.get("status") for m in on_time] == [200, None] and on_time[1]["body"] == b"4"
    no_limit = asyncio.run(_body_under_deadline([(0.05, b"ab"), (0.05, b"c")], timeout_s=0))
    assert no_limit[1]["body"] == b"3"


def test_each_limit_holds_alone_and_at_its_edges() -> None:
    quick = [(0.0, b"ab"), (0.0, b"cd")]
    assert asyncio.run(_body_under_deadline(quick, timeout_s=0.5))[1]["body"] == b"4"  # in time: whole
    slow = [(0.05, b"ab"), (0.05, b"c")]
    assert (
        asyncio.run(_body_under_deadline(slow, timeout_s=0, max_bytes=10))[1]["body"] == b"3"
    )  # no deadline
    assert (
        asyncio.run(_body_under_deadline([(0.0, b"x" * 100)], timeout_s=5))[1]["body"] == b"100"
    )  # no size limit
    assert asyncio.run(_body_under_deadline([(0.0, b"xy")], timeout_s=0, max_bytes=1))[0]["status"] == 413
    assert asyncio.run(_body_under_deadline([(0.0, b"x")], timeout_s=0, max_bytes=1))[0]["status"] == 200
    # Every chunk counts, not the first again: 5 + 30 + 30 passes 64.
    growing = [(0.0, b"a" * 5), (0.0, b"b" * 30), (0.0, b"c" * 30)]
    assert asyncio.run(_body_under_deadline(growing, timeout_s=0, max_bytes=64))[0]["status"] == 413


def test_a_client_gone_while_its_body_is_read_reaches_the_route_as_a_disconnect() -> None:
    sent = asyncio.run(_body_under_deadline([(0.0, b"ab"), (0.0, None)], timeout_s=5, max_bytes=64))
    assert sent == [{"type": "app.saw", "disconnect": True}]


def test_what_is_not_http_passes_both_guards_untouched() -> None:
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    async def never(*_: Any) -> Any:
        raise AssertionError("a guard read or wrote a lifespan scope")

    for guard in (BodyLimit(app, 1, 0.1), APIKeyGuard(app, ["key"])):
        asyncio.run(guard({"type": "lifespan"}, never, never))
    assert seen == ["lifespan", "lifespan"]


def test_content_length_against_a_limit_of_one_and_of_none() -> None:
    """Refused by its Content-Length before a byte is read (`chunks` empty: reading would fail)."""
    declared = [(b"content-length", b"2")]
    assert (
        asyncio.run(_body_under_deadline([], timeout_s=0, max_bytes=1, headers=declared))[0]["status"] == 413
    )
    fits = asyncio.run(_body_under_deadline([(0.0, b"xy")], timeout_s=5, max_bytes=0, headers=declared))
    assert fits[1]["body"] == b"2"  # a limit of 0 is no limit, whatever the header says


def test_only_content_length_counts_as_the_declared_size() -> None:
    """Other headers with large numbers, sorting before and after content-length, say nothing of the body."""
    numbers = [(b"accept-count", b"999999"), (b"x-request-size", b"999999"), (b"content-length", b"2")]
    fits = asyncio.run(_body_under_deadline([(0.0, b"xy")], timeout_s=0, max_bytes=10, headers=numbers))
    assert fits[0]["status"] == 200 and fits[1]["body"] == b"2"
