"""`POST /v1/messages` over the chat path: a Messages request runs as the chat request it means
(messages_protocol.py), and its output comes back as Anthropic's content blocks: a `text` block, then a
`tool_use` block per tool call.

Streamed, it is Anthropic's events, each `event: <type>` with the same `type` in its data:
`message_start` (the message, empty, with the prompt's token count), per block `content_block_start`,
`content_block_delta` (`text_delta`, or `input_json_delta` for a call's arguments) ...,
`content_block_stop`; then `message_delta` (stop reason, output tokens) and `message_stop`. An engine
error after the stream began is an `error` event, and the stream ends.

`POST /v1/messages/count_tokens` gives the prompt's token count (`input_tokens`), as Anthropic's does.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from pagoda.service.api.engine_client import APIError
from pagoda.service.api.messages_protocol import CountTokensRequest, MessagesRequest
from pagoda.service.api.openai_serving import OpenAIServing, StartedChat, chain, drain
from pagoda.service.api.tool_calls import ToolCallStream, parse_calls
from pagoda.service.outputs import RequestOutput

_encoder = msgspec.json.Encoder()

# HTTP status -> Anthropic's error type (its API's "Errors" page).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error in Anthropic's shape, which its SDKs read the message from."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def stop_reason(out: RequestOutput, has_calls: bool) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished output."""
    piece = out.outputs[0]
    if piece.finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(piece.stop_reason, str):  # a stop string, not the end-of-sequence token
        return "stop_sequence", piece.stop_reason
    return "end_turn", None


def message_usage(out: RequestOutput) -> dict[str, int]:
    return {
        "input_tokens": len(out.prompt_token_ids),
        "output_tokens": len(out.outputs[0].token_ids),
        "cache_read_input_tokens": out.metrics.num_cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def tool_use_block(call: dict[str, Any]) -> dict[str, Any] | None:
    """A chat tool call (tool_calls.call_dict) as a `tool_use` block, its input the parsed arguments;
    None when they are no JSON object (a call that max_tokens cut short)."""
    try:
        arguments = json.loads(call["function"]["arguments"] or "{}")
    except json.JSONDecodeError:
        return None
    if not isinstance(arguments, dict):
        return None
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments}


def content_blocks(content: str | None, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A finished completion's blocks: its text (if any), then its calls. A call whose arguments are
    no JSON object stays the model's text, as text that does not parse as a call does."""
    uses = [tool_use_block(c) for c in calls]
    cut = "".join(c["function"]["arguments"] for c, use in zip(calls, uses, strict=True) if use is None)
    text = (content or "") + cut
    return ([{"type": "text", "text": text}] if text else []) + [u for u in uses if u is not None]


def message_body(
    message_id: str,
    model: str,
    content: list[dict[str, Any]],
    reason: tuple[str | None, str | None],
    usage: Any,
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason[0],
        "stop_sequence": reason[1],
        "usage": usage,
    }


class MessagesServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def count_tokens(self, request: CountTokensRequest) -> dict[str, int]:
        """`POST /v1/messages/count_tokens`: the prompt's tokens, as the request would run."""
        rendered = await self.serving.render_chat(self.serving.translated_chat(request.chat_request))
        return {"input_tokens": len(rendered.token_ids)}

    async def create(self, request: MessagesRequest) -> dict[str, Any] | AsyncIterator[bytes]:
        started = await self.serving.start_chat(self.serving.translated_chat(request.chat_request))
        message_id = f"msg_{uuid.uuid4().hex}"
        if request.stream:
            return self._stream(started, message_id)
        final = await drain(started.stream, started.first)
        content, calls = parse_calls(final.outputs[0].text, started.plan, started.parser)
        blocks = content_blocks(content, calls)
        has_calls = any(b["type"] == "tool_use" for b in blocks)
        reason = stop_reason(final, has_calls)
        return message_body(message_id, started.model, blocks, reason, message_usage(final))

    async def _stream(self, started: StartedChat, message_id: str) -> AsyncIterator[bytes]:
        first = started.first
        usage = {"input_tokens": len(first.prompt_token_ids), "output_tokens": 0}
        events = MessageEvents()
        yield events.emit(
            "message_start", message=message_body(message_id, started.model, [], (None, None), usage)
        )
        plan = started.plan
        tools = ToolCallStream(plan, started.parser) if plan.mode != "none" else None
        last = first
        try:
            async for out in chain(first, started.stream):
                last = out
                piece = out.outputs[0]
                deltas = tools.feed(piece.text_delta) if tools else [{"content": piece.text_delta}]
                if piece.finish_reason is not None and tools is not None:
                    deltas += tools.finish()[0]
                for delta in deltas:
                    for event in events.delta(delta):
                        yield event
            for event in events.close():
                yield event
            reason, sequence = stop_reason(last, events.has_calls)
            yield events.emit(
                "message_delta",
                delta={"stop_reason": reason, "stop_sequence": sequence},
                usage={"output_tokens": len(last.outputs[0].token_ids)},
            )
            yield events.emit("message_stop")
        except APIError as exc:  # after the 200 went out: said in the stream
            yield events.emit("error", error=error_body(500, exc.message)["error"])
        finally:
            await started.stream.aclose()  # type: ignore[attr-defined]


@dataclass
class MessageEvents:
    """Chat deltas (content, or tool_calls as ToolCallStream writes them) as Messages stream events.
    One block is open at a time: text opens a text block, a call with an id a tool_use block, and each
    closes the one before."""

    blocks: int = 0  # blocks opened so far: the open one's index is blocks - 1
    open_kind: str | None = None
    has_calls: bool = False

    def emit(self, kind: str, **data: Any) -> bytes:
        payload = _encoder.encode({"type": kind, **data})
        return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"

    def delta(self, delta: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        if delta.get("content"):
            if self.open_kind != "text":
                events += self.close()
                events += self._open("text", {"type": "text", "text": ""})
            text_delta = {"type": "text_delta", "text": delta["content"]}
            events.append(self.emit("content_block_delta", index=self.blocks - 1, delta=text_delta))
        for call in delta.get("tool_calls", ()):
            if "id" in call:  # a new call: its name comes with it
                events += self.close()
                block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
                events += self._open("tool_use", block)
                self.has_calls = True
            arguments = call.get("function", {}).get("arguments", "")
            if arguments and self.open_kind == "tool_use":
                json_delta = {"type": "input_json_delta", "partial_json": arguments}
                events.append(self.emit("content_block_delta", index=self.blocks - 1, delta=json_delta))
        return events

    def close(self) -> list[bytes]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [self.emit("content_block_stop", index=self.blocks - 1)]

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        self.open_kind = kind
        self.blocks += 1
        return [self.emit("content_block_start", index=self.blocks - 1, content_block=block)]
