"""Anthropic's Messages API request (`POST /v1/messages`), as a chat completion request.

Anthropic's SDKs and the tools built on them (Claude's Agent SDK, coding agents given a base URL) call
this API; vLLM serves it beside the OpenAI one. A request is translated into the chat request it means
and served by the chat path, so the template, tools, grammar, sampling and their checks are the chat
API's own:

- `system`: a string or text blocks, the first system turn. `messages`: user and assistant turns,
  content a string or blocks: `text`; in an assistant turn `tool_use` (`id`, `name`, `input`: its
  calls) and `thinking` / `redacted_thinking` (dropped: the templates here take no reasoning back); in
  a user turn `tool_result` (`tool_use_id`, `content` a string or text blocks, `is_error`): a tool turn
  each, before the turn's text, as Anthropic orders them.
- `tools`: client tools (`name`, `description`, `input_schema`); `tool_choice` `auto` / `any` (the
  chat API's `required`) / `tool` with `name` / `none`, and `disable_parallel_tool_use`.
- `max_tokens` (required, as Anthropic requires it), `stop_sequences`, `temperature`, `top_p`,
  `top_k`, and vLLM's sampling extras. `metadata` and `service_tier` are accepted and ignored.

Refused with a 400 naming the field: images, documents and other non-text blocks (this server's models
read text only), Anthropic's server tools (web search, code execution, bash, text editor, computer use:
a `type` other than `custom`), `mcp_servers`, `container`, and extended `thinking` (no reasoning model
here).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from pagoda.service.api.openai_protocol import ChatCompletionRequest, SamplingExtras
from pagoda.service.errors import InvalidRequestError, quoted


class MessagesTool(BaseModel):
    """A client tool. Server tools carry a versioned `type` (`web_search_20250305`, ...)."""

    model_config = ConfigDict(extra="ignore")

    type: str | None = None
    name: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class MessagesRequest(SamplingExtras):
    model: str | None = None
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    tools: list[MessagesTool] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # Refused by name when set (see the module's docstring).
    thinking: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None
    container: Any = None

    def _refuse_unsupported(self) -> None:
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise InvalidRequestError(
                "extended thinking is not supported by this server's models", "thinking"
            )
        if self.mcp_servers:
            raise InvalidRequestError(
                "mcp_servers are not supported: this server runs client tools only", "mcp_servers"
            )
        if self.container is not None:
            raise InvalidRequestError("container is not supported: this server runs no code", "container")

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request this one means; `InvalidRequestError` naming the field otherwise."""
        self._refuse_unsupported()
        if self.prompt_logprobs is not None:  # chat and completions show them; this API has no place
            raise InvalidRequestError("prompt_logprobs is not supported on /v1/messages", "prompt_logprobs")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self._messages(),
            "max_completion_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stop": self.stop_sequences,
            **self.model_dump(include=set(SamplingExtras.model_fields)),  # passed on as they came
        }
        if self.tools:
            body["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            choice, parallel = _chat_tool_choice(self.tool_choice)
            body["tool_choice"], body["parallel_tool_calls"] = choice, parallel
        return ChatCompletionRequest.model_validate(body)

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else _texts(self.system, "system")
            messages.append({"role": "system", "content": system})
        if not self.messages:
            raise InvalidRequestError("messages must hold at least one message", "messages")
        for i, message in enumerate(self.messages):
            role, content = message.get("role"), message.get("content")
            where = f"messages.{i}"
            if role not in ("user", "assistant"):
                raise InvalidRequestError(
                    f"a message's role must be user or assistant, got {quoted(role)}", f"{where}.role"
                )
            if isinstance(content, str):
                messages.append({"role": role, "content": content})
            elif not isinstance(content, list):
                raise InvalidRequestError(
                    "a message's content must be a string or a list of blocks", f"{where}.content"
                )
            elif role == "user":
                messages += _user_turns(content, where)
            else:
                messages.append(_assistant_turn(content, where))
        return messages


class CountTokensRequest(MessagesRequest):
    """`POST /v1/messages/count_tokens`: a Messages request without max_tokens."""

    max_tokens: int | None = None  # type: ignore[assignment]


def _block_type(block: Any) -> str | None:
    return block.get("type") if isinstance(block, dict) else None


def _unsupported_block(kind: str | None, where: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"content blocks of type {quoted(kind)} are not supported here: this server's models read text only",
        f"{where}.type",
    )


def _texts(blocks: list[Any], where: str) -> str:
    """Text blocks' texts, a line apart (a system prompt, a tool result)."""
    texts = []
    for j, block in enumerate(blocks):
        if _block_type(block) != "text":
            raise _unsupported_block(_block_type(block), f"{where}.{j}")
        texts.append(_text(block, f"{where}.{j}"))
    return "\n".join(texts)


def _text(block: dict[str, Any], at: str) -> str:
    if not isinstance(block.get("text"), str):
        raise InvalidRequestError("a text block needs its text as a string", f"{at}.text")
    return str(block["text"])


def _user_turns(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn's tool results as tool turns, then its text as a user turn (if it has any)."""
    tools, texts = [], []
    for j, block in enumerate(blocks):
        kind, at = _block_type(block), f"{where}.content.{j}"
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_result":
            tool_use_id, content = block.get("tool_use_id"), block.get("content", "")
            if isinstance(content, list):
                content = _texts(content, f"{at}.content")
            if not isinstance(tool_use_id, str) or not isinstance(content, str):
                raise InvalidRequestError(
                    "a tool_result block needs tool_use_id (a string) and content (a string or text blocks)",
                    at,
                )
            tools.append({"role": "tool", "tool_call_id": tool_use_id, "content": content})
        else:
            raise _unsupported_block(kind, at)
    return tools + ([{"role": "user", "content": "".join(texts)}] if texts or not tools else [])


def _assistant_turn(blocks: list[Any], where: str) -> dict[str, Any]:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind, at = _block_type(block), f"{where}.content.{j}"
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, dict):
                raise InvalidRequestError(
                    "a tool_use block needs id and name as strings and input as an object", at
                )
            function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
            calls.append({"id": call_id, "type": "function", "function": function})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise _unsupported_block(kind, at)
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _chat_tool(tool: MessagesTool, i: int) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise InvalidRequestError(
            f"tools of type {quoted(tool.type)} are not supported: this server runs client tools only",
            f"tools.{i}.type",
        )
    if tool.name is None:
        raise InvalidRequestError("a tool needs a name", f"tools.{i}.name")
    function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict[str, Any]) -> tuple[str | dict[str, Any], bool]:
    """The chat API's tool_choice and parallel_tool_calls."""
    kind, parallel = choice.get("type"), not choice.get("disable_parallel_tool_use", False)
    if kind in ("auto", "none"):
        return str(kind), parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidRequestError(
        'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
        '{"type": "tool", "name": ...}',
        "tool_choice",
    )
