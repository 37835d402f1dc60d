"""OpenAI chat and text completions over the engine client: request → prompt + SamplingParams, and
RequestOutputs → OpenAI response objects (openai_responses.py) or SSE chunks. No engine logic; errors
are APIError.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from msgspec import UNSET, UnsetType
from pydantic import ValidationError

from pagoda.service.api.engine_client import APIError, EngineClient, ServingState, now_s
from pagoda.service.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from pagoda.service.api.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    Chunk,
    Completion,
    CompletionChoice,
    CompletionChunkChoice,
    CompletionLogprobs,
    Detokenized,
    ErrorBody,
    ErrorResponse,
    Load,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    Rendered,
    TokenLogprob,
    Tokens,
    Usage,
    encode,
)
from pagoda.service.api.tool_calls import ParserName, ToolCallStream, ToolPlan, parse_calls
from pagoda.service.errors import InvalidRequestError
from pagoda.service.outputs import Logprob, RequestOutput
from pagoda.service.sampling_params import SamplingParams

_DONE = object()


def sse(payload: Chunk | ErrorResponse | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else encode(payload)
    return b"data: " + data + b"\n\n"


# APIError kind -> (HTTP status, OpenAI error type): a refusal's body, and an error event mid-stream.
HTTP_ERRORS: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "not_found": (404, "invalid_request_error"),
    "queue_full": (503, "server_overloaded_error"),
    "unavailable": (503, "service_unavailable_error"),
    "internal": (500, "internal_server_error"),
}


def error_event(exc: APIError) -> ErrorResponse:
    """An error after the headers went out: the same body a refusal before them carries."""
    return ErrorResponse(ErrorBody(exc.message, HTTP_ERRORS[exc.kind][1], exc.param, exc.code))


def usage_of(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.metrics.num_cached_tokens for o in outputs)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))


@dataclass(frozen=True)
class StartedChat:
    """A chat request running in the engine: its output stream (the first output already read), the
    tool plan and parser its text is read with, and the model name responses carry."""

    stream: AsyncIterator[RequestOutput]
    first: RequestOutput
    plan: ToolPlan
    parser: ParserName | None
    model: str


@dataclass(frozen=True)
class StreamChunks:
    """The SSE chunks of one streamed response, chat or text completion, built in one place: each
    carries the response's id, object, created time and model; with `stream_options.include_usage`,
    every choice chunk has `"usage": null` and a last chunk with no choices has the usage, as OpenAI
    streams them."""

    object: Literal["chat.completion.chunk", "text_completion"]
    response_id: str
    created: int
    model: str
    include_usage: bool

    def choice(self, choice: ChatChunkChoice | CompletionChunkChoice) -> bytes:
        usage = None if self.include_usage else UNSET
        choices: Any = [choice]
        return sse(Chunk(self.response_id, self.object, self.created, self.model, choices, usage))

    def usage(self, outputs: list[RequestOutput]) -> bytes:
        return sse(Chunk(self.response_id, self.object, self.created, self.model, [], usage_of(outputs)))


def _chat_logprobs(logprobs: list[Logprob] | None) -> ChatLogprobs | None:
    if logprobs is None:
        return None

    def top(lp: Logprob) -> list[TokenLogprob]:
        return [TokenLogprob(t.token, t.logprob, list(t.token.encode("utf-8"))) for t in lp.top]

    return ChatLogprobs(
        [ChatTokenLogprob(lp.token, lp.logprob, list(lp.token.encode("utf-8")), top(lp)) for lp in logprobs]
    )


def _completion_logprobs(logprobs: list[Logprob] | None, text_offset: int) -> CompletionLogprobs | None:
    if logprobs is None:
        return None
    offsets = []
    for lp in logprobs:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return CompletionLogprobs(
        [lp.token for lp in logprobs],
        [lp.logprob for lp in logprobs],
        [{t.token: t.logprob for t in lp.top} for lp in logprobs],
        offsets,
    )


def _prompt_logprobs(out: RequestOutput, client: EngineClient, k: int) -> CompletionLogprobs | None:
    """The echoed prompt's part of a completion's `logprobs` (None for its first token), with each
    position's top `k` (the engine may hold more, for `prompt_logprobs`)."""
    if out.prompt_logprobs is None:
        return None
    tokens = client.token_strings(out.prompt_token_ids)
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens,
        [None if lp is None else lp.logprob for lp in out.prompt_logprobs],
        [None if lp is None else {t.token: t.logprob for t in lp.top[:k]} for lp in out.prompt_logprobs],
        offsets,
    )


def vllm_prompt_logprobs(out: RequestOutput, k: int | None) -> PromptLogprobs | UnsetType:
    """vLLM's `prompt_logprobs` (asked for with `k`): per position the prompt's token with its rank,
    then the position's top `k` (ranks 1..k) less that token; None for the first position."""
    if k is None or out.prompt_logprobs is None:
        return UNSET
    positions: PromptLogprobs = []
    for lp in out.prompt_logprobs:
        if lp is None:
            positions.append(None)
            continue
        entry = {lp.token_id: PromptLogprob(lp.logprob, lp.rank, lp.token)}
        for rank, t in enumerate(lp.top[:k], 1):
            entry.setdefault(t.token_id, PromptLogprob(t.logprob, rank, t.token))
        positions.append(entry)
    return positions


def _tool_finish(finish_reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's finish_reason for a completion that ended in tool calls (a cut-off one stays "length")."""
    return "tool_calls" if made_calls and finish_reason == "stop" else finish_reason


def _join_logprobs(
    head: CompletionLogprobs | None, tail: CompletionLogprobs | None
) -> CompletionLogprobs | None:
    if head is None or tail is None:
        return head or tail
    return CompletionLogprobs(
        head.tokens + tail.tokens,
        head.token_logprobs + tail.token_logprobs,
        head.top_logprobs + tail.top_logprobs,
        head.text_offset + tail.text_offset,
    )


class OpenAIServing:
    def __init__(self, client: EngineClient) -> None:
        self.client = client

    def models(self) -> ModelList:
        if self.client.state is ServingState.LOADING:
            raise self.client.unavailable_error()
        created, base, max_len = now_s(), self.client.model_name, self.client.max_model_len
        cards = [ModelCard(base, created, max_len)]
        cards += [
            ModelCard(name, created, max_len, root=path, parent=base)
            for name, path in sorted(self.client.lora_adapters().items())
        ]
        return ModelList(cards)

    def model(self, model_id: str) -> ModelCard:
        """`GET /v1/models/{id}`: the served model or one of its LoRA adapters, or a 404 naming it."""
        listed = self.models().data
        card = next((c for c in listed if c.id == model_id), None)
        if card is None:
            self.client.check_model(model_id)  # raises
            raise AssertionError(model_id)
        return card

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        """vLLM's `POST /v1/load_lora_adapter`: serve another adapter (PEFT folder) from now on."""
        if request.lora_name == self.client.model_name:
            self.client.metrics.count_error("invalid_request")
            raise APIError("invalid_request", "a LoRA adapter cannot take the base model's name", "lora_name")
        await self.client.lora_op(request.lora_name, request.lora_path)
        return f"Success: LoRA adapter '{request.lora_name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        """vLLM's `POST /v1/unload_lora_adapter`: requests running under it end; new ones get a 404."""
        await self.client.lora_op(request.lora_name, None)
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

    async def tokenize(self, request: TokenizeRequest) -> Tokens:
        self.client.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            self.client.metrics.count_error("invalid_request")
            raise APIError("invalid_request", "give exactly one of prompt and messages", "prompt")
        if request.messages is not None:
            try:
                messages = request.chat_messages()
            except InvalidRequestError as exc:
                self.client.metrics.count_error("invalid_request")
                raise APIError("invalid_request", str(exc), param=exc.param) from exc
            tokens = await self.client.render_chat(messages, request.add_generation_prompt)
        else:
            assert request.prompt is not None
            tokens = await self.client.tokenize(request.prompt, request.add_special_tokens)
        result = Tokens(len(tokens), self.client.max_model_len, tokens)
        if request.return_token_strs:
            result.token_strs = self.client.token_strings(tokens)
        return result

    def translated_chat(self, translate: Callable[[], ChatCompletionRequest]) -> ChatCompletionRequest:
        """The chat request another API's request means (the Responses and Messages APIs'
        `chat_request`); what it refuses, or a chat field then refuses (a tool's name, max_tokens), is
        a 400 naming the field."""
        try:
            return translate()
        except InvalidRequestError as exc:
            self.client.metrics.count_error("invalid_request")
            raise APIError("invalid_request", str(exc), param=exc.param) from exc
        except ValidationError as exc:
            self.client.metrics.count_error("invalid_request")
            first = exc.errors()[0]
            param = ".".join(str(part) for part in first["loc"])
            raise APIError("invalid_request", f"{param}: {first['msg']}", param=param) from exc

    async def render_chat(self, request: ChatCompletionRequest) -> Rendered:
        """`POST /v1/chat/completions/render`: the token ids the chat request would run on."""
        self.client.check_model(request.model)
        try:
            messages, plan = request.chat_messages(), request.tool_plan
        except InvalidRequestError as exc:
            self.client.metrics.count_error("invalid_request")
            raise APIError("invalid_request", str(exc), param=exc.param) from exc
        return Rendered(
            await self.client.render_chat(
                messages, request.add_generation_prompt, plan.template_tools, request.chat_template_kwargs
            )
        )

    async def render_completion(self, request: CompletionRequest) -> list[Rendered]:
        """`POST /v1/completions/render`: the token ids of each prompt, as generation would encode it."""
        self.client.check_model(request.model)
        try:
            prompts = request.prompts()
        except InvalidRequestError as exc:
            self.client.metrics.count_error("invalid_request")
            raise APIError("invalid_request", str(exc), param=exc.param) from exc
        return [Rendered(p if isinstance(p, list) else await self.client.tokenize(p)) for p in prompts]

    def load(self) -> Load:
        stats = self.client.stats_or_none()
        return Load(stats.num_waiting + stats.num_running if stats is not None else self.client.num_in_flight)

    async def detokenize(self, request: DetokenizeRequest) -> Detokenized:
        self.client.check_model(request.model)
        return Detokenized(await self.client.detokenize(request.tokens))

    async def _start(
        self, prompts: list[str | list[int]], params: SamplingParams, lora_name: str | None = None
    ) -> tuple[list[Any], list[Any]]:
        """Admit and start one engine request per prompt; return (streams, first outputs). Any error
        surfaces here, before a response (or an SSE stream) begins. The caller has checked the request
        and its sampling parameters; the engine client checks each prompt against the model."""
        admission = self.client.admit(len(prompts))  # a batch is admitted whole, or not at all
        base_id = uuid.uuid4().hex
        streams = [
            self.client.generate(p, params, f"{base_id}-{i}", admission, lora_name)
            for i, p in enumerate(prompts)
        ]
        # All prompts enter the engine together (one at a time, each would wait for the last one's
        # first token). The first error, if any, is raised once every stream has stopped.
        try:
            results = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
        finally:
            admission.release()  # the streams that never started
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for stream in streams:
                await stream.aclose()
            raise errors[0]
        return streams, results

    # ---- chat -----------------------------------------------------------------------------------------
    async def start_chat(self, request: ChatCompletionRequest) -> StartedChat:
        """Check a chat request, render its prompt and start it in the engine (the Responses API's
        path too); every error surfaces here, before a response begins."""
        lora = self.client.check_model(request.model)
        try:
            messages, plan, params = request.chat_messages(), request.tool_plan, request.sampling_params()
        except InvalidRequestError as exc:
            self.client.metrics.count_error("invalid_request")
            raise APIError("invalid_request", str(exc), param=exc.param) from exc
        prompt = await self.client.render_chat(
            messages, request.add_generation_prompt, plan.template_tools, request.chat_template_kwargs
        )
        streams, firsts = await self._start([prompt], params, lora)
        return StartedChat(
            streams[0], firsts[0], plan, self.client.tool_parser, lora or self.client.model_name
        )

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletion | AsyncIterator[bytes]:
        started = await self.start_chat(request)
        response_id, created, model = f"chatcmpl-{uuid.uuid4().hex}", now_s(), started.model
        plan, parser = started.plan, started.parser
        if request.stream:
            return self._chat_stream(
                started.stream, started.first, request, plan, parser, response_id, created, model
            )
        final = await drain(started.stream, started.first)
        choices = []
        for c in final.outputs:
            content, calls = parse_calls(c.text, plan, parser)
            message = ChatMessage("assistant", content, calls or UNSET)
            finish = _tool_finish(c.finish_reason, bool(calls))
            choices.append(ChatChoice(c.index, message, _chat_logprobs(c.logprobs), finish, c.stop_reason))
        prompt_logprobs = vllm_prompt_logprobs(final, request.prompt_logprobs)
        return ChatCompletion(
            response_id, created, model, choices, usage_of([final]), prompt_logprobs=prompt_logprobs
        )

    async def _chat_stream(
        self,
        stream: AsyncIterator[RequestOutput],
        first: RequestOutput,
        request: ChatCompletionRequest,
        plan: ToolPlan,
        parser: ParserName | None,
        response_id: str,
        created: int,
        model: str,
    ) -> AsyncIterator[bytes]:
        chunks = StreamChunks("chat.completion.chunk", response_id, created, model, request.include_usage)

        def chunk(
            index: int, delta: dict[str, Any], logprobs: ChatLogprobs | None = None, finish: str | None = None
        ) -> bytes:
            return chunks.choice(ChatChunkChoice(index, delta, logprobs, finish))

        last = first
        done: set[int] = set()
        # With tools, text passes through one ToolCallStream per completion (it holds back call text).
        tool_streams = (
            {c.index: ToolCallStream(plan, parser) for c in first.outputs} if plan.mode != "none" else {}
        )
        try:
            for c in first.outputs:
                yield chunk(c.index, {"role": "assistant", "content": ""})
            async for out in chain(first, stream):
                last = out
                for c in out.outputs:
                    tools = tool_streams.get(c.index)
                    if tools is not None:
                        for delta in tools.feed(c.text_delta):
                            yield chunk(c.index, delta)
                    elif c.text_delta or c.logprobs_delta:
                        yield chunk(c.index, {"content": c.text_delta}, _chat_logprobs(c.logprobs_delta))
                    if c.finish_reason is not None and c.index not in done:
                        done.add(c.index)
                        made_calls = False
                        if tools is not None:
                            deltas, made_calls = tools.finish()
                            for delta in deltas:
                                yield chunk(c.index, delta)
                        yield chunk(c.index, {}, None, _tool_finish(c.finish_reason, made_calls))
            if chunks.include_usage:
                yield chunks.usage([last])
            yield sse("[DONE]")
        except APIError as exc:  # after the 200 went out: report in the stream, as OpenAI does
            yield sse(error_event(exc))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    # ---- text completions -------------------------------------------------------------------------------
    async def completions(self, request: CompletionRequest) -> Completion | AsyncIterator[bytes]:
        lora = self.client.check_model(request.model)
        try:
            prompts, params = request.prompts(), request.sampling_params()
        except InvalidRequestError as exc:
            self.client.metrics.count_error("invalid_request")
            raise APIError("invalid_request", str(exc), param=exc.param) from exc
        streams, firsts = await self._start(prompts, params, lora)
        response_id, created, model = f"cmpl-{uuid.uuid4().hex}", now_s(), lora or self.client.model_name
        # The prompt as the model saw it: with truncate_prompt_tokens, its last tokens only.
        truncated = params.truncate_prompt_tokens is not None
        echoes = [
            (self.client.decode(f.prompt_token_ids) if truncated else self._echo_text(p))
            if request.echo
            else ""
            for p, f in zip(prompts, firsts, strict=True)
        ]
        n = request.n
        if request.stream:
            return self._completion_stream(streams, firsts, echoes, n, request, response_id, created, model)
        finals = await asyncio.gather(*(drain(s, f) for s, f in zip(streams, firsts, strict=True)))
        choices = []
        for p, final in enumerate(finals):
            for c in final.outputs:
                logprobs = _join_logprobs(
                    _prompt_logprobs(final, self.client, request.logprobs or 0) if request.echo else None,
                    _completion_logprobs(c.logprobs, len(echoes[p])),
                )
                choices.append(
                    CompletionChoice(
                        p * n + c.index, echoes[p] + c.text, logprobs, c.finish_reason, c.stop_reason,
                        vllm_prompt_logprobs(final, request.prompt_logprobs),
                    )
                )  # fmt: skip
        return Completion(response_id, created, model, choices, usage_of(list(finals)))

    def _echo_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.client.decode(prompt)

    async def _completion_stream(
        self,
        streams: list[AsyncIterator[RequestOutput]],
        firsts: list[RequestOutput],
        echoes: list[str],
        n: int,
        request: CompletionRequest,
        response_id: str,
        created: int,
        model: str,
    ) -> AsyncIterator[bytes]:
        chunks = StreamChunks("text_completion", response_id, created, model, request.include_usage)
        lasts = list(firsts)
        # Each choice's text_offset so far: the echo, then its tokens' lengths, as the answer not
        # streamed counts them (not the text sent: a stop string or held-back bytes make that shorter).
        offsets = {(p, i): 0 for p in range(len(streams)) for i in range(n)}
        echoed: set[tuple[int, int]] = set()
        done: set[tuple[int, int]] = set()

        try:
            async for p, out in _merge([chain(f, s) for f, s in zip(firsts, streams, strict=True)]):
                lasts[p] = out
                for c in out.outputs:
                    key = (p, c.index)
                    prefix = "" if key in echoed else echoes[p]
                    echoed.add(key)
                    finish = c.finish_reason if key not in done else None
                    if finish is not None:
                        done.add(key)
                    if prefix or c.text_delta or c.logprobs_delta or finish is not None:
                        logprobs = _completion_logprobs(c.logprobs_delta, offsets[key] + len(prefix))
                        if prefix:
                            logprobs = _join_logprobs(
                                _prompt_logprobs(out, self.client, request.logprobs or 0), logprobs
                            )
                        offsets[key] += len(prefix) + sum(len(lp.token) for lp in c.logprobs_delta or [])
                        text = prefix + c.text_delta
                        yield chunks.choice(CompletionChunkChoice(p * n + c.index, text, logprobs, finish))
            if chunks.include_usage:
                yield chunks.usage(lasts)
            yield sse("[DONE]")
        except APIError as exc:
            yield sse(error_event(exc))
        finally:
            for stream in streams:
                await stream.aclose()  # type: ignore[attr-defined]


async def chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    if first.finished:
        return
    async for out in rest:
        yield out


async def drain(stream: AsyncIterator[RequestOutput], first: RequestOutput) -> RequestOutput:
    last = first
    async for out in chain(first, stream):
        last = out
    return last


async def _merge(iterators: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams as their items arrive, tagged with the stream's position."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(position: int, iterator: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in iterator:
                await queue.put((position, item))
        except BaseException as exc:
            await queue.put((position, exc))
            raise
        finally:
            await queue.put((position, _DONE))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        num_open = len(tasks)
        while num_open:
            position, item = await queue.get()
            if item is _DONE:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
