"""The OpenAI API's response bodies, as msgspec Structs: typed where the serving code builds them, and
encoded straight to JSON bytes (msgspec encodes a Struct faster than a dict, and several times faster
than FastAPI's own encoder, which matters per streamed chunk).

A field left `UNSET` is not sent at all, where OpenAI leaves the key out (`tool_calls` of a message
without calls, `usage` of a chunk unless `stream_options.include_usage`); a field set to None is sent
as null, where OpenAI sends null. Tool calls and chat deltas stay dicts: tool_calls.py builds them
piece by piece as a streamed call grows.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

_encoder = msgspec.json.Encoder()


def encode(body: Struct | list[Any] | dict[str, Any]) -> bytes:
    """A response body as UTF-8 JSON."""
    return _encoder.encode(body)


class PromptTokensDetails(Struct):
    cached_tokens: int


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TokenLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(Struct):
    """The legacy completions shape; an echoed prompt's first token has no logprob (None)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(Struct):
    """vLLM's entry for one token at one prompt position (`prompt_logprobs`)."""

    logprob: float
    rank: int | None
    decoded_token: str


# Per prompt position: the prompt's token and its position's top k, by token id; None for the first.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class ChatMessage(Struct):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[dict[str, Any]] | UnsetType = UNSET


class ChatChoice(Struct):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # vLLM's, when asked for


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: None = None
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # vLLM's, when asked for


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: None = None


class ChatChunkChoice(Struct):
    index: int
    delta: dict[str, Any]  # role / content / tool_calls, as OpenAI streams them
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class CompletionChunkChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Chunk(Struct):
    """One SSE event of a streamed chat or text completion."""

    id: str
    object: Literal["chat.completion.chunk", "text_completion"]
    created: int
    model: str
    choices: list[ChatChunkChoice] | list[CompletionChunkChoice]
    usage: Usage | UnsetType | None = UNSET


class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int
    object: Literal["model"] = "model"
    owned_by: str = "pagoda"
    root: str | None = None  # vLLM's: a LoRA adapter's path
    parent: str | None = None  # vLLM's: the base model a LoRA adapter adapts


class ModelList(Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class Tokens(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | UnsetType = UNSET


class Detokenized(Struct):
    prompt: str


class Rendered(Struct):
    """A prompt as the model will see it (vLLM's `/v1/.../render`): routers key prefix affinity on it."""

    token_ids: list[int]


class Load(Struct):
    """`GET /get_load` (SGLang's and vllm-router's power-of-two policy): requests waiting + running."""

    load: int


class ErrorBody(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct):
    error: ErrorBody
