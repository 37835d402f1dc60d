"""The one engine client that the HTTP and gRPC adapters share.

It owns what a server adds around the engine: the life cycle (loading → ready → draining), admission
(backpressure on the waiting queue), in-flight tracking for the drain, request metrics, and the
mapping of engine failures to `APIError`. The adapters translate their protocol to and from it and
hold no engine logic.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from pagoda.service import gc_pauses
from pagoda.service.api.tool_calls import CHAT_ROLES, ParserName, parser_for, template_messages
from pagoda.service.engine.client.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from pagoda.service.engine.client.input_processor import check_text_fits
from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.messages import EngineStats
from pagoda.service.errors import InvalidRequestError, quoted
from pagoda.service.metrics import RequestTracker, ServerMetrics
from pagoda.service.outputs import RequestOutput
from pagoda.service.sampling_params import SamplingParams
from pagoda.service.tokenizer import RELEASE_GIL_CHARS

logger = logging.getLogger(__name__)

ErrorKind = Literal["invalid_request", "not_found", "queue_full", "unavailable", "internal"]


class ServingState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STALLED = "stalled"  # work pending, no step for longer than the stall timeout: liveness fails too
    UNHEALTHY = "unhealthy"


class APIError(Exception):
    """A request refused or failed; each adapter maps `kind` to its status code."""

    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s


class Admission:
    """Requests admitted together that count as waiting until each starts (`take`) or is dropped
    (`release`: whatever was not taken)."""

    def __init__(self, client: EngineClient, count: int) -> None:
        self._client = client
        self.remaining = count
        client._admitted += count

    def take(self) -> None:
        if self.remaining > 0:
            self.remaining -= 1
            self._client._admitted -= 1

    def release(self) -> None:
        self._client._admitted -= self.remaining
        self.remaining = 0


class EngineClient:
    """Wraps one AsyncEngine. `engine_factory(config)` builds it (blocking) in a worker thread.

    The transports see the engine only through this class: it owns prompt processing (chat templates,
    tokens as text) and maps every engine failure to an `APIError`, so HTTP and gRPC answer alike."""

    def __init__(
        self,
        config: EngineConfig,
        engine_factory: Callable[[EngineConfig], AsyncEngine],
        max_waiting_requests: int = 0,
        enable_gpu_metrics: bool = True,
        tool_call_parser: str = "auto",
        stall_timeout_s: float = 0.0,
    ) -> None:
        """`stall_timeout_s`: see `ServingState.STALLED`; 0 never stalls."""
        self.config = config
        self.stall_timeout_s = stall_timeout_s
        self.tool_call_parser = tool_call_parser
        self._engine_factory = engine_factory
        self.max_waiting_requests = max_waiting_requests  # 0: no limit
        self._engine: AsyncEngine | None = None
        self._state = ServingState.LOADING
        self.state_changed = asyncio.Event()  # set on every explicit transition (health mirrors wait on it)
        self._admitted = 0  # admitted, not yet in flight (see `admit`)
        self._idle = asyncio.Event()
        self._idle.set()
        self.metrics = ServerMetrics(self.stats_or_none, lambda: self.model_name, enable_gpu_metrics)

    # ---- life cycle -------------------------------------------------------------------------------
    async def load(self, also: Callable[[], Awaitable[None]] | None = None) -> None:
        """Build the engine off the event loop (the tokenizer), then start its core process from this
        thread, then await `also()` (the other API server processes' start) before turning READY;
        UNHEALTHY (and raise) on failure."""
        try:
            engine = await asyncio.to_thread(self._engine_factory, self.config)
            engine.observe_delay = self.metrics.observe_output_delay
            self._engine = engine
            await engine.start()
            if also is not None:
                await also()
        except BaseException:
            self._state = ServingState.UNHEALTHY
            self.state_changed.set()
            raise
        self._engine = engine
        gc_pauses.freeze()  # the tokenizer, the app and the libraries live as long as the process
        if self._state is ServingState.LOADING:
            self._state = ServingState.READY
            self.state_changed.set()
        logger.info("model %s ready (context %d tokens)", self.model_name, self.max_model_len)

    @property
    def state(self) -> ServingState:
        if self._state is ServingState.READY and self._engine is not None and not self._engine.is_healthy:
            return ServingState.UNHEALTHY
        if self._state in (ServingState.READY, ServingState.DRAINING) and self.is_stalled:
            return ServingState.STALLED  # not for good: the state it had comes back with the next step
        return self._state

    @property
    def stalled_for(self) -> float:
        """Seconds with requests pending and no step from the engine core (0: none pending)."""
        return self._engine.stalled_for() if self._engine is not None else 0.0

    @property
    def is_stalled(self) -> bool:
        return self.stall_timeout_s > 0 and self.stalled_for > self.stall_timeout_s

    @property
    def is_ready(self) -> bool:
        return self.state is ServingState.READY

    @property
    def num_in_flight(self) -> int:
        """Requests from `generate` until their stream closes: the engine's registry, the only one."""
        return self._engine.num_requests if self._engine is not None else 0

    def fail(self, message: str) -> None:
        """Unhealthy for good (another process of the server died): open streams end, health fails."""
        logger.error("%s", message)
        self._state = ServingState.UNHEALTHY
        self.state_changed.set()
        if self._engine is not None:
            self._engine.fail(message)

    def start_drain(self) -> None:
        """Refuse new requests from now on; in-flight ones continue."""
        if self._state is not ServingState.UNHEALTHY:
            self._state = ServingState.DRAINING
            self.state_changed.set()

    async def wait_idle(self, timeout_s: float, force: asyncio.Event | None = None) -> bool:
        """Wait for in-flight requests to finish. Past `timeout_s` (or once `force` is set) abort them in
        the engine, freeing their KV cache, and return False; the caller then closes their connections."""
        waits = {asyncio.ensure_future(self._idle.wait())}
        if force is not None:
            waits.add(asyncio.ensure_future(force.wait()))
        _, pending = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if self._idle.is_set():
            return True
        reason = (
            "second signal" if force is not None and force.is_set() else f"drain timeout ({timeout_s:.1f} s)"
        )
        logger.warning("%s: aborting %d requests", reason, self.num_in_flight)
        for request_id in self._engine.request_ids if self._engine is not None else []:
            self.abort(request_id)
        return False

    async def shutdown(self) -> None:
        if self._engine is not None:
            await self._engine.shutdown()

    # ---- the served model -----------------------------------------------------------------------
    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise self.unavailable_error()
        return self._engine

    @property
    def model_name(self) -> str:
        if self.config.served_model_name:
            return str(self.config.served_model_name)
        return str(self._engine.model_name) if self._engine is not None else ""

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted(self.engine.tokenizer.eos_token_ids)

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt's token ids for a conversation, through the model's chat template. Checks what
        every transport must refuse alike: no messages, an unknown role. `template_kwargs`: more
        variables for the template (vLLM's `chat_template_kwargs`, e.g. a thinking model's
        `enable_thinking`); they may not replace what the request itself gives it."""
        try:
            check_chat_messages(messages)
            given = {"messages", "add_generation_prompt", "tools", *self.engine.tokenizer.special_tokens}
            reserved = sorted(given & set(template_kwargs or {}))
            if reserved:
                raise InvalidRequestError(
                    f"chat_template_kwargs may not set {reserved[0]}: send it as the request's own field",
                    "chat_template_kwargs",
                )
        except InvalidRequestError as exc:
            self.metrics.count_error("invalid_request")
            raise APIError("invalid_request", str(exc), exc.param) from exc
        # Chat templates know system/user/assistant; OpenAI's newer "developer" role is a system prompt.
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        tokenizer = self.engine.tokenizer
        messages = template_messages(messages, tokenizer.chat_template or "")
        extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **extra
            )
        except Exception as exc:
            self.metrics.count_error("invalid_request")
            raise APIError(
                "invalid_request", f"messages do not fit the chat template: {exc}", "messages"
            ) from exc
        # The template writes BOS itself where the model wants one.
        if len(text) > RELEASE_GIL_CHARS:  # off the event loop (the tokenizer releases the GIL then)
            return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=False)
        return tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self.engine.tokenizer.decode(token_ids)

    @property
    def tool_parser(self) -> ParserName | None:
        """The served model's tool-call format (its chat template's, unless `tool_call_parser` says)."""
        return parser_for(self.engine.tokenizer.chat_template or "", self.tool_call_parser)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (off the event loop when it is long); a 400 past what the context holds."""
        tokenizer = self.engine.tokenizer
        try:
            check_text_fits(text, self.max_model_len, tokenizer)
        except InvalidRequestError as exc:
            self.metrics.count_error("invalid_request")
            raise APIError("invalid_request", str(exc), exc.param) from exc
        if len(text) > RELEASE_GIL_CHARS:
            return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of token ids, special tokens included (off the event loop when they are many); a 400
        for ids outside the vocabulary or more ids than the context holds (no sequence has more)."""
        vocab_size, limit = self.engine.vocab_size, self.max_model_len
        if len(token_ids) > limit:
            self.metrics.count_error("invalid_request")
            raise APIError(
                "invalid_request", f"{len(token_ids)} token ids, more than the context's {limit}", "tokens"
            )
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            self.metrics.count_error("invalid_request")
            raise APIError(
                "invalid_request", f"token ids out of range [0, {vocab_size}): {bad[:5]}", "tokens"
            )
        decode = functools.partial(self.engine.tokenizer.decode, token_ids, skip_special_tokens=False)
        # ~4 characters a token: the same point at which `tokenize` leaves the loop
        return await asyncio.to_thread(decode) if len(token_ids) > RELEASE_GIL_CHARS // 4 else decode()

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token as the vocabulary spells it (OpenAI's `logprobs.tokens`)."""
        return [self.engine.tokenizer.id_to_token(t) for t in token_ids]

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the served model, or no name); a
        `not_found` APIError for any other name."""
        if not name or name == self.model_name:
            return None
        adapters = self.lora_adapters()
        if name in adapters:
            return name
        self.metrics.count_error("not_found")
        served = ", ".join(repr(n) for n in [self.model_name, *adapters])
        raise APIError(
            "not_found",
            f"The model {quoted(name)} does not exist; this server serves {served}.",
            param="model",
            code="model_not_found",
        )

    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters the engine serves (name -> path), as its last stats said."""
        stats = self.stats_or_none()
        return stats.lora_adapters if stats is not None else {}

    async def lora_op(self, name: str, path: str | None) -> None:
        """Load (`path` given) or unload a LoRA adapter in the engine; APIError: why not (400, or
        404 for an adapter that is not loaded)."""
        error = await self.engine.lora_op(name, path)
        if error is None:
            return
        if error.startswith("no LoRA adapter"):
            self.metrics.count_error("not_found")
            raise APIError("not_found", error, param="lora_name")
        self.metrics.count_error("invalid_request")
        raise APIError("invalid_request", error, param="lora_path")

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def stats_or_none(self) -> EngineStats | None:
        return self._engine.stats() if self._engine is not None else None

    # ---- requests ----------------------------------------------------------------------------------
    def unavailable_error(self) -> APIError:
        state = self.state
        messages = {
            ServingState.LOADING: "The model is still loading; retry shortly.",
            ServingState.DRAINING: "The server is shutting down and takes no new requests.",
            ServingState.UNHEALTHY: "The engine is not healthy.",
            ServingState.STALLED: f"The engine has made no progress for {self.stalled_for:.0f} s.",
        }
        return APIError("unavailable", messages.get(state, "unavailable"), code=state.value, retry_after_s=5)

    def admit(self, num_requests: int = 1) -> Admission:
        """Raise an APIError when `num_requests` new requests cannot be taken now: not ready, or the
        waiting queue would pass its limit (a batch larger than the limit itself is a 400: it never fits).
        The admitted requests count as waiting from now until each enters `generate` (a batch's streams
        start a loop turn later, when requests arriving meanwhile are admitted too): pass the returned
        `Admission` to `generate` and `release()` it once they have started."""
        if not self.is_ready:
            self.metrics.count_error("unavailable")
            raise self.unavailable_error()
        if self.max_waiting_requests > 0:
            if num_requests > self.max_waiting_requests:
                self.metrics.count_error("invalid_request")
                raise APIError(
                    "invalid_request",
                    f"this request holds {num_requests} prompts, more than the {self.max_waiting_requests} "
                    "the server lets wait at once (--max-waiting-requests); send it in smaller batches",
                    "prompt",
                )
            stats = self.engine.stats()
            # Requests handed to the engine but not yet in its queue count as waiting too.
            num_waiting = max(stats.num_waiting, self.num_in_flight + self._admitted - stats.num_running)
            if num_waiting + num_requests > self.max_waiting_requests:
                self.metrics.count_error("queue_full")
                raise APIError(
                    "queue_full",
                    f"The server is overloaded: {num_waiting} requests are waiting "
                    f"(limit {self.max_waiting_requests}); retry later.",
                    code="queue_full",
                    retry_after_s=1,
                )
        return Admission(self, num_requests)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        admission: Admission | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Admission and validation errors raise APIError before the first
        output; closing the iterator early (client gone) aborts the request in the engine. `admission`:
        the caller already admitted it, with its batch (`admit(len(batch))`)."""
        own = admission is None
        admission = self.admit() if admission is None else admission
        request_id = request_id or uuid.uuid4().hex
        engine = self.engine
        if engine.has_request(request_id):  # refused before anything could touch the live one
            if own:
                admission.release()
            self.metrics.count_error("invalid_request")
            message = f"request id {quoted(request_id)} is already in use"
            raise APIError("invalid_request", message, "request_id")
        tracker = RequestTracker(self.metrics)
        admission.take()  # from admitted to in flight (the engine registers it, in the same loop turn)
        self._idle.clear()
        finished = failed = False
        stream = engine.generate(prompt, params, request_id, lora_name)
        try:
            async for out in stream:
                tracker.observe(out)
                finished = out.finished
                yield out
        except InvalidRequestError as exc:
            failed = True
            self.metrics.count_error("invalid_request")
            code = "context_length_exceeded" if "context" in str(exc) else None
            raise APIError("invalid_request", str(exc), param=exc.param, code=code) from exc
        except (APIError, asyncio.CancelledError, GeneratorExit):
            raise
        except EngineDeadError as exc:
            failed = True
            self.metrics.count_error("unavailable")
            raise APIError("unavailable", f"The engine is not healthy: {exc}", code="unhealthy") from exc
        except RequestFailedError as exc:
            failed = True
            self.metrics.count_error("internal")
            logger.error("request %s failed inside the engine: %s", request_id, exc)
            raise APIError("internal", f"The engine failed on this request (others go on): {exc}") from exc
        except Exception as exc:
            failed = True
            self.metrics.count_error("internal")
            logger.exception("request %s failed", request_id)
            raise APIError("internal", f"The engine failed on this request: {exc}") from exc
        finally:
            if not finished:
                engine.abort(request_id)
                if not failed:  # closed early: the client went away or the drain timed out
                    tracker.close()
            await stream.aclose()
            if engine.num_requests == 0:
                self._idle.set()

    def abort(self, request_id: str) -> None:
        if self._engine is not None:
            self._engine.abort(request_id)


def check_chat_messages(messages: list[dict[str, Any]]) -> None:
    """`InvalidRequestError` for a conversation no transport may pass on to the template."""
    if not messages:
        raise InvalidRequestError("messages must contain at least one message", "messages")
    for i, message in enumerate(messages):
        if message.get("role") not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                f"got {quoted(message.get('role'))}",
                f"messages.{i}.role",
            )


def now_s() -> int:
    """Unix time in whole seconds, for OpenAI's `created`."""
    return int(time.time())
