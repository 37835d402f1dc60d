"""The OpenAI API's request bodies, as pydantic models, and their translation to SamplingParams.

Parameters OpenAI accepts that Pagoda does not act on (`tools`, `suffix`, `best_of`, ...) are
ignored, never fatal: `extra="ignore"`. Structured output (`response_format`, vLLM's `guided_*`) and
`logit_bias` come from `StructuredOutputFields` (structured_output.py). A few vLLM extensions
(`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`) are honoured.
Responses are plain dicts built in openai_serving.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from pagoda.service.api.structured_output import StructuredOutputFields
from pagoda.service.sampling_params import InvalidRequestError, SamplingParams


def find_lone_surrogate(value: Any, path: str = "") -> str | None:
    """Where the first string holding a lone UTF-16 surrogate (JSON's "\\ud800") is, or None. Python's
    JSON parser lets them through; no tokenizer, or UTF-8 response, can take them."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"{path or 'body'} (character {exc.start})"
    elif isinstance(value, dict):
        for key, item in value.items():
            found = find_lone_surrogate(key, path) or find_lone_surrogate(item, f"{path}.{key}".lstrip("."))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if found := find_lone_surrogate(item, f"{path}.{i}".lstrip(".")):
                return found
    return None


class _Request(StructuredOutputFields):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if where := find_lone_surrogate(data):
            raise PydanticCustomError(
                "invalid_unicode",
                "invalid Unicode in {where}: a lone surrogate; send text as valid UTF-8",
                {"where": where},
            )
        return data

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions.
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = Field(default_factory=list)
    skip_special_tokens: bool = True

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        params = SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            grammar=self.grammar(),
            logit_bias=self.token_bias(),
        )
        params.validate()
        return params


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def sampling_params(self) -> SamplingParams:
        if not self.messages:
            raise InvalidRequestError("messages must contain at least one message", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, 20], got {self.top_logprobs}", "top_logprobs"
            )
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)

    def chat_messages(self) -> list[dict[str, Any]]:
        # Chat templates know system/user/assistant; OpenAI's newer "developer" role is a system prompt.
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None

    def sampling_params(self) -> SamplingParams:
        params = self._sampling_params(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = self.logprobs  # the echoed prompt comes with its scores
        return params

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: strings, or token-id lists."""
        prompt = self.prompt
        if isinstance(prompt, str):
            prompts: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]  # type: ignore[arg-type]
        else:
            prompts = list(prompt)  # type: ignore[arg-type]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InvalidRequestError("prompt must not be empty", "prompt")
        return prompts


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
