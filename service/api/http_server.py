"""The HTTP routes: the OpenAI API, health probes and `/metrics`, a few lines each over the client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from msgspec import Struct
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda import __version__
from pagoda.service.api.engine_client import APIError, EngineClient, ServingState
from pagoda.service.api.http_guards import APIKeyGuard, BodyLimit
from pagoda.service.api.messages_protocol import CountTokensRequest, MessagesRequest
from pagoda.service.api.messages_serving import MessagesServing
from pagoda.service.api.messages_serving import error_body as messages_error_body
from pagoda.service.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from pagoda.service.api.openai_responses import ErrorBody, ErrorResponse, encode
from pagoda.service.api.openai_serving import HTTP_ERRORS, OpenAIServing
from pagoda.service.api.responses_protocol import ResponsesRequest
from pagoda.service.api.responses_serving import ResponsesServing
from pagoda.service.metrics import CONTENT_TYPE


def error_response(
    status: int,
    message: str,
    error_type: str,
    param: str | None = None,
    code: str | None = None,
    **headers: str,
) -> Response:
    body = ErrorResponse(ErrorBody(message, error_type, param, code))
    return json_response(body, status, headers or None)


def shaped_error(
    request: Request, status: int, message: str, error_type: str, param: str | None = None, **headers: str
) -> Response:
    """An error in the shape its API's clients read: Anthropic's under /v1/messages, else OpenAI's."""
    if request.url.path.startswith("/v1/messages"):
        return Response(
            encode(messages_error_body(status, message)),
            status_code=status,
            headers=headers or None,
            media_type="application/json",
        )
    return error_response(status, message, error_type, param, **headers)


def json_response(body: Struct, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A typed response body (openai_responses.py), encoded by msgspec rather than FastAPI's encoder."""
    return Response(encode(body), status_code=status, headers=headers, media_type="application/json")


DEFAULT_MAX_REQUEST_BYTES = 16 << 20
DEFAULT_BODY_READ_TIMEOUT_S = 30.0  # 16 MB in 30 s is ~4 Mbit/s: any client that means it


def build_app(
    client: EngineClient,
    api_keys: Sequence[str] = (),
    allowed_origins: Sequence[str] = (),
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S,
) -> FastAPI:
    """The HTTP app. `api_keys`: if any, every route but the probes and /metrics needs one of them;
    `allowed_origins`: CORS origins (none: no CORS headers); `max_request_bytes`,
    `body_read_timeout_s`: 0 for no limit."""
    app = FastAPI(title="Pagoda", version=__version__, docs_url=None, redoc_url=None)
    serving = OpenAIServing(client)
    responses = ResponsesServing(serving)
    messages = MessagesServing(serving)
    # Added innermost first: CORS answers preflights, then the key is checked, then the body read.
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes, timeout_s=body_read_timeout_s)
    if api_keys:
        app.add_middleware(APIKeyGuard, keys=api_keys)
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
    client.metrics.instrument_http(app)  # last: the outermost middleware

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        status, error_type = HTTP_ERRORS[exc.kind]
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else {}
        if request.url.path.startswith("/v1/messages"):
            return shaped_error(request, status, exc.message, error_type, **headers)
        return error_response(status, exc.message, error_type, exc.param, exc.code, **headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        client.metrics.count_error("invalid_request")
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = ".".join(loc) or None
        message = (
            f"{param}: {first.get('msg', 'invalid')}" if param else str(first.get("msg", "invalid body"))
        )
        return shaped_error(request, 400, message, "invalid_request_error", param)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> Response:
        # Still JSON in the API's shape; the traceback goes to the log (Starlette logs it after this).
        client.metrics.count_error("internal")
        message = f"Internal server error: {type(exc).__name__}"
        return shaped_error(request, 500, message, "internal_server_error")

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return shaped_error(request, exc.status_code, str(exc.detail), error_type)

    @app.get("/v1/health/live")
    async def live() -> JSONResponse:
        # A dead engine core is not coming back, a stalled one may never: fail liveness too, so
        # Kubernetes restarts the pod (the stall timeout is the grace a legitimate long step gets).
        is_dead = client.state in (ServingState.UNHEALTHY, ServingState.STALLED)
        return JSONResponse({"status": "dead" if is_dead else "live"}, status_code=503 if is_dead else 200)

    @app.get("/v1/health/ready")
    async def ready() -> JSONResponse:
        state = client.state
        return JSONResponse({"status": state.value}, status_code=200 if state is ServingState.READY else 503)

    @app.get("/health")
    async def health() -> Response:
        # vLLM's probe, which routers call (vllm-router at start, sglang-router always): 200 while serving.
        return Response(status_code=200 if client.state is ServingState.READY else 503)

    @app.get("/get_load")
    async def get_load() -> Response:
        return json_response(serving.load())

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: ChatCompletionRequest) -> Response:
        return json_response(await serving.render_chat(request))

    @app.post("/v1/responses/render")
    async def render_response(request: ResponsesRequest) -> Response:
        return json_response(await responses.render(request))

    @app.post("/v1/completions/render")
    async def render_completion(request: CompletionRequest) -> Response:
        return Response(encode(await serving.render_completion(request)), media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(client.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response(serving.models())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        return json_response(serving.model(model_id))

    if serving.client.config.lora is not None:  # vLLM's run-time adapter endpoints

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
            return PlainTextResponse(await serving.load_lora_adapter(request))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
            return PlainTextResponse(await serving.unload_lora_adapter(request))

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> Response:
        return json_response(await serving.tokenize(request))

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> Response:
        return json_response(await serving.detokenize(request))

    @app.post("/v1/chat/completions")
    async def chat(request: ChatCompletionRequest, raw: Request) -> Response:
        return _respond(await _unless_disconnected(raw, serving.chat(request)))

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        return _respond(await _unless_disconnected(raw, serving.completions(request)))

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw: Request) -> Response:
        return _respond(await _unless_disconnected(raw, responses.create(request)))

    @app.post("/v1/messages")
    async def create_message(request: MessagesRequest, raw: Request) -> Response:
        return _respond(await _unless_disconnected(raw, messages.create(request)))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: CountTokensRequest) -> Response:
        return _respond(await messages.count_tokens(request))

    return app


async def _disconnected(raw: Request) -> None:
    """Return once the client has gone (the JSON body is already read: what comes next is that)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(raw: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client goes away first (a non-streamed request waiting for its last token),
    cancel it: closing its engine streams aborts them and frees their KV blocks."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    return task.result()


def _respond(result: Any) -> Response:
    if isinstance(result, Response):
        return result
    if isinstance(result, Struct):
        return json_response(result)
    if isinstance(result, dict):  # a Responses or Messages API object (responses_serving.py, ...)
        return Response(encode(result), media_type="application/json")
    # A client that goes away cancels this stream; closing it aborts the engine request.
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
