"""`POST /v1/responses` over the chat path: a Responses request runs as the chat request it means
(responses_protocol.py), and its output comes back as Responses output items: a `message` with one
`output_text` part, then a `function_call` item per tool call.

Streamed, it is OpenAI's typed events, each `event: <type>` with the same `type` and a
`sequence_number` in its data: `response.created`, `response.in_progress`, per item
`response.output_item.added`, (a message) `response.content_part.added`, `response.output_text.delta`
..., `response.output_text.done`, `response.content_part.done`, (a call)
`response.function_call_arguments.delta` ..., `.done`, then `response.output_item.done`; last
`response.completed`, or `response.incomplete` when `max_output_tokens` cut the output. An engine
error after the stream began is an `error` event, then `response.failed`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pagoda.service.api.engine_client import APIError, now_s
from pagoda.service.api.openai_responses import Rendered
from pagoda.service.api.openai_serving import OpenAIServing, StartedChat, chain, drain
from pagoda.service.api.responses_protocol import ResponsesRequest
from pagoda.service.api.tool_calls import ToolCallStream, parse_calls
from pagoda.service.outputs import RequestOutput

_encoder = msgspec.json.Encoder()


def response_usage(out: RequestOutput) -> dict[str, Any]:
    prompt, completion = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": out.metrics.num_cached_tokens},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "id": item_id or f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [part] if status != "in_progress" else [],
    }


def call_item(call: dict[str, Any], status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    """A chat tool call (tool_calls.call_dict) as a Responses `function_call` item."""
    return {
        "id": item_id or f"fc_{uuid.uuid4().hex}",
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
    }


def output_items(content: str | None, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A finished completion's items: its text as a message (an empty one if there is nothing else),
    then its calls."""
    output = [message_item(content or "")] if content or not calls else []
    return output + [call_item(c) for c in calls]


@dataclass(frozen=True)
class ResponseShell:
    """What every response object of one request carries beside its status, output and usage."""

    request: ResponsesRequest
    model: str
    response_id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=now_s)

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        r = self.request
        text_format = (
            r.text.format.model_dump(by_alias=True, exclude_unset=True) if r.text else {"type": "text"}
        )
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "metadata": r.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,  # nothing is kept (responses_protocol.py)
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": text_format},
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()],
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": r.user,
        }


def final_status(out: RequestOutput) -> str:
    return "incomplete" if out.outputs[0].finish_reason == "length" else "completed"


class ResponsesServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def render(self, request: ResponsesRequest) -> Rendered:
        """`POST /v1/responses/render` (vLLM's): the token ids the request would run on; routers key
        prefix affinity on them."""
        return await self.serving.render_chat(self.serving.translated_chat(request.chat_request))

    async def create(self, request: ResponsesRequest) -> dict[str, Any] | AsyncIterator[bytes]:
        started = await self.serving.start_chat(self.serving.translated_chat(request.chat_request))
        shell = ResponseShell(request, started.model)
        if request.stream:
            return self._stream(started, shell)
        final = await drain(started.stream, started.first)
        content, calls = parse_calls(final.outputs[0].text, started.plan, started.parser)
        return shell.body(final_status(final), output_items(content, calls), response_usage(final))

    async def _stream(self, started: StartedChat, shell: ResponseShell) -> AsyncIterator[bytes]:
        events = ResponseEvents()
        yield events.emit("response.created", response=shell.body("in_progress", [], None))
        yield events.emit("response.in_progress", response=shell.body("in_progress", [], None))
        plan = started.plan
        tools = ToolCallStream(plan, started.parser) if plan.mode != "none" else None
        last = started.first
        try:
            async for out in chain(started.first, started.stream):
                last = out
                piece = out.outputs[0]
                deltas = tools.feed(piece.text_delta) if tools else [{"content": piece.text_delta}]
                if piece.finish_reason is not None and tools is not None:
                    deltas += tools.finish()[0]
                for delta in deltas:
                    for event in events.delta(delta):
                        yield event
            for event in events.finish():
                yield event
            status = final_status(last)
            yield events.emit(
                f"response.{status}", response=shell.body(status, events.items, response_usage(last))
            )
        except APIError as exc:  # after the 200 went out: said in the stream
            yield events.emit("error", code=exc.code or exc.kind, message=exc.message, param=exc.param)
            failed = shell.body("failed", events.items, None)
            failed["error"] = {"code": exc.code or exc.kind, "message": exc.message}
            yield events.emit("response.failed", response=failed)
        finally:
            await started.stream.aclose()  # type: ignore[attr-defined]


@dataclass
class ResponseEvents:
    """Chat deltas (content, or tool_calls as ToolCallStream writes them) as Responses stream events.
    One item is open at a time: text opens a message, a call with an id opens a function_call, and
    each closes the one before."""

    items: list[dict[str, Any]] = field(default_factory=list)  # closed, in output order
    sequence: int = 0
    open_item: dict[str, Any] | None = None
    text: str = ""  # the open message's text, or the open call's arguments

    def emit(self, kind: str, **data: Any) -> bytes:
        payload = _encoder.encode({"type": kind, "sequence_number": self.sequence, **data})
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"

    def delta(self, delta: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        if delta.get("content"):
            if self.open_item is None or self.open_item["type"] != "message":
                events += self.close()
                events += self._open(message_item("", "in_progress"))
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                events.append(
                    self.emit("response.content_part.added", **self._where(), content_index=0, part=part)
                )
            self.text += delta["content"]
            events.append(
                self.emit(
                    "response.output_text.delta",
                    **self._where(),
                    content_index=0,
                    delta=delta["content"],
                    logprobs=[],
                )
            )
        for call in delta.get("tool_calls", ()):
            if "id" in call:  # a new call: its name comes with it
                events += self.close()
                events += self._open(
                    call_item({**call, "function": {**call["function"], "arguments": ""}}, "in_progress")
                )
            arguments = call.get("function", {}).get("arguments", "")
            if arguments and self.open_item is not None:
                self.text += arguments
                events.append(
                    self.emit("response.function_call_arguments.delta", **self._where(), delta=arguments)
                )
        return events

    def finish(self) -> list[bytes]:
        """The last item's closing events; an output with neither text nor calls still holds one
        (empty) message, as the unstreamed one does."""
        return self.close() if self.items or self.open_item else self._empty_message()

    def _empty_message(self) -> list[bytes]:
        events = self._open(message_item("", "in_progress"))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events.append(self.emit("response.content_part.added", **self._where(), content_index=0, part=part))
        return events + self.close()

    def close(self) -> list[bytes]:
        """The open item's closing events; it joins `items`."""
        item = self.open_item
        if item is None:
            return []
        where = self._where()
        if item["type"] == "message":
            done = message_item(self.text, item_id=item["id"])
            part = done["content"][0]
            events = [
                self.emit("response.output_text.done", **where, content_index=0, text=self.text, logprobs=[]),
                self.emit("response.content_part.done", **where, content_index=0, part=part),
            ]
        else:
            done = {**item, "status": "completed", "arguments": self.text}
            events = [
                self.emit(
                    "response.function_call_arguments.done", **where, name=item["name"], arguments=self.text
                )
            ]
        events.append(self.emit("response.output_item.done", output_index=where["output_index"], item=done))
        self.items.append(done)
        self.open_item, self.text = None, ""
        return events

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        self.open_item, self.text = item, ""
        return [self.emit("response.output_item.added", output_index=len(self.items), item=item)]

    def _where(self) -> dict[str, Any]:
        assert self.open_item is not None
        return {"item_id": self.open_item["id"], "output_index": len(self.items)}
