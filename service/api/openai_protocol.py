"""The OpenAI API's request bodies, as pydantic models, and their translation to SamplingParams.

Parameters OpenAI accepts that Pagoda cannot honour (`suffix`, `best_of` other than `n`, audio, image
parts, `prediction`, the old `functions`) are refused with a 400 naming them; fields OpenAI does not
define are ignored (`extra="ignore"`). Tools are tool_calls.py's. Structured output
(`response_format`, vLLM's `guided_*`) and `logit_bias` come from `StructuredOutputFields`
(structured_output.py). A few vLLM extensions
(`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`,
`allowed_token_ids`, `truncate_prompt_tokens`, `include_stop_str_in_output`) are honoured; the vLLM
extensions that would change what a request produces and that Pagoda does not implement (beam search,
`bad_words`, ...) are refused by name when set, never silently ignored.
Responses are typed msgspec Structs (openai_responses.py), built in openai_serving.py.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from pagoda.service.api.structured_output import StructuredOutputFields
from pagoda.service.api.tool_calls import (
    ChatRole,
    ToolCall,
    ToolChoice,
    ToolDefinition,
    ToolPlan,
    plan_tools,
)
from pagoda.service.errors import InvalidRequestError, quoted
from pagoda.service.sampling_params import SamplingParams


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


def refuse_lone_surrogates(data: Any) -> Any:
    """A pydantic "before" check: a 400 naming where the first lone surrogate is."""
    if where := find_lone_surrogate(data):
        raise PydanticCustomError(
            "invalid_unicode",
            "invalid Unicode in {where}: a lone surrogate; send text as valid UTF-8",
            {"where": where},
        )
    return data


class SamplingExtras(BaseModel):
    """The sampling fields every generation request shares (chat, completions, and the Responses API,
    which passes them on to its chat request): OpenAI's seed and penalties, vLLM's extensions. Unknown
    fields are ignored; a lone surrogate anywhere in the body is a 400."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return refuse_lone_surrogates(data)

    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM extensions.
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = Field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    include_stop_str_in_output: bool = False
    # Chat and completions only (the Responses and Messages APIs refuse it): each prompt token's
    # logprob and rank, with its position's top k, in vLLM's `prompt_logprobs` shape; not streamed.
    prompt_logprobs: int | None = None
    # vLLM extensions not implemented here: refused by name when set (`refuse_unimplemented_vllm`).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    bad_words: list[str] | None = None
    return_tokens_as_token_ids: bool = False

    def refuse_unimplemented_vllm(self) -> None:
        """A 400 naming the first vLLM extension set that Pagoda does not implement: ignored, each would
        hand back other output than the client asked for."""
        unimplemented = {
            "use_beam_search": self.use_beam_search,
            "length_penalty": self.length_penalty != 1.0,
            "bad_words": bool(self.bad_words),
            "return_tokens_as_token_ids": self.return_tokens_as_token_ids,
        }
        for name, asked in unimplemented.items():
            if asked:
                raise InvalidRequestError(f"{name} is not supported by this server", name)


class _Request(StructuredOutputFields, SamplingExtras):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True  # vLLM's

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")
        self.refuse_unimplemented_vllm()
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError(
                "prompt_logprobs are not available when stream is true", "prompt_logprobs"
            )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
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
            allowed_token_ids=None if self.allowed_token_ids is None else list(self.allowed_token_ids),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=self.prompt_logprobs,
        )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: ChatRole
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # role "tool": the call this result answers
    tool_calls: list[ToolCall] | None = None  # role "assistant": the calls it made

    def text(self, index: int) -> str:
        if not isinstance(self.content, list):
            return self.content or ""
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise InvalidRequestError(
                    f"content parts of type {quoted(part.type)} are not supported: this server's models read "
                    "text only",
                    f"messages.{index}.content.{j}.type",
                )
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the chat template
    continue_final_message: bool = False  # vLLM's; not implemented: refused when set
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # Accepted by OpenAI, not honoured here: refused by name rather than ignored.
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None

    @functools.cached_property
    def tool_plan(self) -> ToolPlan:
        """Built once per request (its grammar comes from the tools' schemas); sampling and the
        template both read it."""
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def _refuse_unsupported(self) -> None:
        unsupported = {
            "audio": self.audio is not None or (self.modalities is not None and self.modalities != ["text"]),
            "prediction": self.prediction is not None,
            "web_search_options": self.web_search_options is not None,
            "functions": self.functions is not None,
            "function_call": self.function_call is not None,
            "continue_final_message": self.continue_final_message,
        }
        for name, asked in unsupported.items():
            if asked:
                hint = "; use tools and tool_choice" if name.startswith("function") else ""
                raise InvalidRequestError(f"{name} is not supported by this server{hint}", name)

    def sampling_params(self) -> SamplingParams:
        self._refuse_unsupported()
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
        params = self._sampling_params(max_tokens, logprobs)
        plan = self.tool_plan
        if plan.grammar is not None:
            if params.grammar is not None:
                raise InvalidRequestError(
                    f"{params.grammar.param} cannot be combined with tool_choice {plan.mode}", "tool_choice"
                )
            params.grammar = plan.grammar
        return params

    def chat_messages(self) -> list[dict[str, Any]]:
        """The turns as chat templates take them (the engine client maps roles and tool calls)."""
        messages = []
        for i, m in enumerate(self.messages):
            message: dict[str, Any] = {"role": m.role, "content": m.text(i)}
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.name is not None:
                message["name"] = m.name
            messages.append(message)
        return messages


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    # Accepted by OpenAI, not honoured here: refused by name rather than ignored.
    suffix: str | None = None
    best_of: int | None = None

    def sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise InvalidRequestError("suffix (fill-in-the-middle) is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(
                f"best_of other than n is not supported (best_of {self.best_of}, n {self.n})", "best_of"
            )
        params = self._sampling_params(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:  # the echoed prompt comes with its scores
            params.prompt_logprobs = max(self.logprobs, self.prompt_logprobs or 0)
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


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a `prompt`, or chat `messages` rendered through the template first."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for a prompt; a rendered chat has its special tokens already
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return refuse_lone_surrogates(data)

    def chat_messages(self) -> list[dict[str, Any]]:
        assert self.messages is not None
        return ChatCompletionRequest.model_construct(messages=self.messages).chat_messages()


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's `POST /v1/load_lora_adapter`."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's `POST /v1/unload_lora_adapter` (vLLM's optional `lora_int_id` is taken and unused)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
