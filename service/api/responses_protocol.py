"""OpenAI's Responses API request (`POST /v1/responses`), as a chat completion request.

The Responses API is what the OpenAI Agents SDK's default model and OpenAI's newer examples call. A
request here is translated into the chat request it means and served by the chat path, so tools,
structured output, sampling and their checks are the chat API's own:

- `input`: a string (one user turn) or items: messages (`role` user / system / developer / assistant,
  content a string or `input_text` / `output_text` / `refusal` parts), `function_call` items (an
  assistant turn's calls; consecutive ones, and the assistant text before them, make one turn) and
  `function_call_output` items (a tool turn). `reasoning` items are dropped: the templates here take
  no reasoning back. `instructions` becomes the first system turn.
- `tools`: function tools (`{"type": "function", "name", "description", "parameters", "strict"}`);
  `tool_choice` `none` / `auto` / `required` / `{"type": "function", "name"}`; `text.format` `text` /
  `json_object` / `json_schema` (`name`, `schema`, `strict` beside `type`, not nested as in chat);
  `max_output_tokens`, `temperature`, `top_p`, `parallel_tool_calls`, and vLLM's sampling extras.

This server keeps no responses: `store` is accepted and reported false (vLLM does the same unless told
to store), and what needs a stored one (`previous_response_id`, `conversation`, `item_reference`
items, `background`) is refused with a 400 that says to send the conversation in `input`. Hosted
tools (web search, file search, computer use, code interpreter, MCP), images, files and audio are
refused by name, as the chat API refuses audio.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagoda.service.api.openai_protocol import ChatCompletionRequest, SamplingExtras
from pagoda.service.errors import InvalidRequestError, quoted

_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class FunctionTool(BaseModel):
    """A Responses function tool: the chat API's `function` fields, flat beside `type`."""

    model_config = ConfigDict(extra="ignore")

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(SamplingExtras):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    user: str | None = None
    # What needs a stored response: refused by name.
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    top_logprobs: int | None = None

    def _refuse_unsupported(self) -> None:
        stored = "this server keeps no responses: send the whole conversation in input"
        if self.previous_response_id is not None:
            raise InvalidRequestError(
                f"previous_response_id is not supported: {stored}", "previous_response_id"
            )
        if self.conversation is not None:
            raise InvalidRequestError(f"conversation is not supported: {stored}", "conversation")
        if self.background:
            raise InvalidRequestError("background responses are not supported by this server", "background")
        if self.prompt is not None:
            raise InvalidRequestError("prompt templates are not supported: send input", "prompt")
        if self.top_logprobs:
            raise InvalidRequestError("top_logprobs is not supported on /v1/responses", "top_logprobs")
        if self.truncation not in (None, "disabled"):
            raise InvalidRequestError(
                f"truncation {quoted(self.truncation)} is not supported: only disabled (a prompt longer "
                "than the model's context is refused)",
                "truncation",
            )

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request this one means; `InvalidRequestError` naming the field otherwise."""
        self._refuse_unsupported()
        if self.prompt_logprobs is not None:  # chat and completions show them; this API has no place
            raise InvalidRequestError("prompt_logprobs is not supported on /v1/responses", "prompt_logprobs")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self._messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            **self.model_dump(include=set(SamplingExtras.model_fields)),  # passed on as they came
        }
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise InvalidRequestError(
                    "text.format of type json_schema needs schema", "text.format.schema"
                )
            schema = {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        return ChatCompletionRequest.model_validate(body)

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        if not self.input:
            raise InvalidRequestError("input must hold at least one item", "input")
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                messages.append(_message(item, i))
            elif kind == "function_call":
                call = _function_call(item, i)
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # its text, or the calls before
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append(_function_call_output(item, i))
            elif kind == "reasoning":
                continue
            elif kind == "item_reference":
                raise InvalidRequestError(
                    "item_reference is not supported: this server keeps no responses; send the item itself",
                    f"input.{i}",
                )
            else:
                raise InvalidRequestError(
                    f"input items of type {quoted(kind)} are not supported: this server takes messages, "
                    "function_call and function_call_output items",
                    f"input.{i}.type",
                )
        return messages


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequestError(
            f"a message's role must be user, system, developer or assistant, got {quoted(role)}",
            f"input.{i}.role",
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise InvalidRequestError(
            "a message's content must be a string or a list of parts", f"input.{i}.content"
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise InvalidRequestError(
                f"content parts of type {quoted(kind)} are not supported: this server's models read "
                "text only",
                f"input.{i}.content.{j}.type",
            )
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"a {kind} part needs its text as a string", f"input.{i}.content.{j}")
        texts.append(text)
    return {"role": role, "content": "".join(texts)}


def _function_call(item: dict[str, Any], i: int) -> dict[str, Any]:
    name, arguments, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
    if not isinstance(name, str) or not isinstance(arguments, str) or not isinstance(call_id, str):
        raise InvalidRequestError(
            "a function_call item needs call_id, name and arguments (JSON text) as strings", f"input.{i}"
        )
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _function_call_output(item: dict[str, Any], i: int) -> dict[str, Any]:
    call_id, output = item.get("call_id"), item.get("output")
    if isinstance(output, list):  # parts, as a message's content
        output = _message({"role": "user", "content": output}, i)["content"]
    if not isinstance(call_id, str) or not isinstance(output, str):
        raise InvalidRequestError(
            "a function_call_output item needs call_id and output as strings", f"input.{i}"
        )
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _chat_tool(tool: FunctionTool, i: int) -> dict[str, Any]:
    if tool.type != "function":
        raise InvalidRequestError(
            f"tools of type {quoted(tool.type)} are not supported: this server runs function tools only",
            f"tools.{i}.type",
        )
    if tool.name is None:
        raise InvalidRequestError("a function tool needs a name", f"tools.{i}.name")
    function: dict[str, Any] = {
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
    }
    if tool.strict is not None:
        function["strict"] = tool.strict
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # none / auto / required: the chat API checks the word
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError(
        'tool_choice must be none, auto, required or {"type": "function", "name": ...}', "tool_choice"
    )
