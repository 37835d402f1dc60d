"""The Responses API's request as the chat request it means, and its stream events, without a server
(tests/test_serve_responses.py runs them through a real `pagoda serve` and the `openai` client)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from pagoda.service.api.engine_client import APIError
from pagoda.service.api.openai_protocol import ChatCompletionRequest
from pagoda.service.api.openai_serving import OpenAIServing, StartedChat
from pagoda.service.api.responses_protocol import ResponsesRequest
from pagoda.service.api.responses_serving import (
    ResponseEvents,
    ResponseShell,
    ResponsesServing,
    output_items,
    response_usage,
)
from pagoda.service.api.tool_calls import plan_tools
from pagoda.service.errors import InvalidRequestError
from pagoda.service.outputs import CompletionOutput, RequestMetrics, RequestOutput

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def text(kind: str, value: str) -> dict[str, str]:
    return {"type": kind, "text": value}


def call_item(call_id: str, city: str) -> dict[str, str]:
    arguments = json.dumps({"city": city})
    return {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": arguments}


def chat_call(call_id: str, city: str) -> dict[str, Any]:
    arguments = json.dumps({"city": city})
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def tool_delta(index: int, arguments: str, name: str | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if name is not None:  # a call's first delta: its id, type and name
        call = {
            "index": index,
            "id": f"call_{index + 1}",
            "type": "function",
            "function": {"name": name, **call["function"]},
        }
    return {"tool_calls": [call]}


def chat_of(**body: Any) -> Any:
    return ResponsesRequest.model_validate(body).chat_request()


def test_a_string_input_is_one_user_turn_after_the_instructions() -> None:
    chat = chat_of(model="m", input="Hello", instructions="Be brief.", max_output_tokens=7, temperature=0.5)
    assert chat.chat_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
    ]
    params = chat.sampling_params()
    assert (params.max_tokens, params.temperature, chat.model) == (7, 0.5, "m")


def test_unset_fields_sample_as_the_chat_api_does() -> None:
    """Neither streamed nor parallel-less by default, and every sampling default the chat API's."""
    request = ResponsesRequest.model_validate({"input": "x"})
    assert request.stream is False and request.chat_request().parallel_tool_calls is True
    ours = request.chat_request().sampling_params()
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}]}
    ).sampling_params()
    assert ours == chat
    extras: dict[str, Any] = {"seed": 7, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2}
    extras |= {"presence_penalty": 0.5, "frequency_penalty": -0.5, "ignore_eos": True, "min_tokens": 2}
    extras["stop_token_ids"] = [3]
    asked = ResponsesRequest.model_validate({"input": "x", **extras}).chat_request().sampling_params()
    assert {k: getattr(asked, k) for k in extras} == extras  # passed on as they came


def test_lone_surrogates_are_refused() -> None:
    with pytest.raises(ValidationError, match="lone surrogate"):
        ResponsesRequest.model_validate({"input": [{"role": "user", "content": "a\ud800"}]})


def test_items_become_turns_an_agent_loop_sends_back() -> None:
    """An agent SDK's second turn: the user's message, the assistant's text and its two calls (one
    assistant turn), both outputs, a reasoning item (dropped)."""
    chat = chat_of(
        input=[
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [text("input_text", "Paris"), text("text", " and Rome?")]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [text("output_text", "Looking.")]},
            call_item("call_a", "Paris"),
            call_item("call_b", "Rome"),
            {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_b", "output": [text("input_text", "rain")]},
        ],
        tools=[WEATHER],
    )  # fmt: skip
    calls = [chat_call("call_a", "Paris"), chat_call("call_b", "Rome")]
    assert chat.chat_messages() == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Paris and Rome?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": calls},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_a"},
        {"role": "tool", "content": "rain", "tool_call_id": "call_b"},
    ]  # fmt: skip


def test_calls_without_text_open_their_own_assistant_turn() -> None:
    chat = chat_of(
        input=[
            {"role": "user", "content": "Paris?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
        ],
        tools=[WEATHER],
    )
    roles = [(m["role"], [c["id"] for c in m.get("tool_calls", ())]) for m in chat.chat_messages()]
    assert roles == [("user", []), ("assistant", ["c1"]), ("tool", []), ("assistant", ["c2"])]


def test_tools_choice_and_text_format_take_the_chat_shapes() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat = chat_of(
        input="x",
        tools=[{**WEATHER, "strict": True}],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
    )
    assert chat.tools is not None and chat.tools[0].function.name == "get_weather"
    assert chat.tools[0].function.parameters == WEATHER["parameters"] and chat.tools[0].function.strict
    plan = chat.tool_plan
    assert (plan.mode, plan.name, chat.parallel_tool_calls) == ("named", "get_weather", False)
    assert chat_of(input="x", tools=[WEATHER], tool_choice="required").tool_plan.mode == "required"
    fmt = chat_of(input="x", text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    assert fmt.response_format is not None and fmt.response_format.json_schema is not None
    assert fmt.response_format.json_schema.json_schema == schema
    grammar = fmt.sampling_params().grammar
    assert grammar is not None and grammar.param == "response_format"
    assert chat_of(input="x", text={"format": {"type": "json_object"}}).sampling_params().grammar is not None
    assert chat_of(input="x", text={"format": {"type": "text"}}).sampling_params().grammar is None


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
        ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
        ({"background": True}, "background", "background"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates"),
        ({"top_logprobs": 2}, "top_logprobs", "top_logprobs"),
        ({"truncation": "auto"}, "truncation", "only disabled"),
        ({"input": []}, "input", "at least one item"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0", "keeps no responses"),
        ({"input": [{"type": "web_search_call", "id": "ws"}]}, "input.0.type", "web_search_call"),
        # Types that sort before or between the ones taken (a comparison made of `==` would take them).
        ({"input": [{"type": "computer_call", "call_id": "c", "output": "x"}]}, "input.0.type", "computer"),
        ({"input": [{"type": "file_search_call", "call_id": "c"}]}, "input.0.type", "file_search_call"),
        ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input.0", "call_id"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role", "user, system, developer or"),
        ({"input": [{"role": "user", "content": 3}]}, "input.0.content", "string or a list of parts"),
        (
            {"input": [{"role": "user", "content": [text("input_text", "a"), {"type": "input_image"}]}]},
            "input.0.content.1.type",
            "input_image",
        ),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0", "call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input.0", "output"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "function tools only"),
        ({"tools": [{"type": "file_search", "name": "f"}]}, "tools.0.type", "function tools only"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "must be none"),
        ({"tools": [WEATHER], "tool_choice": {"type": "allowed", "name": "f"}}, "tool_choice", "must be"),
        ({"tools": [WEATHER], "tool_choice": {"type": "mcp", "name": "f"}}, "tool_choice", "must be none"),
        ({"tools": [{"type": "function"}]}, "tools.0.name", "needs a name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools"}}, "tool_choice", "must be none"),
        ({"text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema", "needs schema"),
    ],
)  # fmt: skip
def test_what_it_cannot_honour_is_refused_by_name(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words) as raised:
        chat_of(**{"input": "x", **body})
    assert raised.value.param == param


def events_of(chunks: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for chunk in chunks:
        head, data = chunk.decode().removesuffix("\n\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        out.append(event)
    return out


def test_deltas_become_items_opened_and_closed_in_order() -> None:
    """Text, then a call streamed by pieces (a named tool), then a whole call (as `required` ends):
    each item closes before the next opens; the done events carry the whole text and arguments."""
    events = ResponseEvents()
    chunks = [events.emit("response.created", response={})]
    for delta in [
        {"content": "Hel"},
        {"content": ""},
        {"content": "lo"},
        tool_delta(0, '{"a"', name="f"),
        tool_delta(0, ": 1}"),
        tool_delta(1, "{}", name="g"),
    ]:  # fmt: skip
        chunks += events.delta(delta)
    chunks += events.close()
    assert events.close() == []  # nothing open any more
    seen = events_of(chunks)
    assert [e["sequence_number"] for e in seen] == list(range(len(seen)))
    brief = [(e["type"].removeprefix("response."), e.get("output_index")) for e in seen]
    assert brief == [
        ("created", None),
        ("output_item.added", 0), ("content_part.added", 0),
        ("output_text.delta", 0), ("output_text.delta", 0),
        ("output_text.done", 0), ("content_part.done", 0), ("output_item.done", 0),
        ("output_item.added", 1), ("function_call_arguments.delta", 1), ("function_call_arguments.delta", 1),
        ("function_call_arguments.done", 1), ("output_item.done", 1),
        ("output_item.added", 2), ("function_call_arguments.delta", 2),
        ("function_call_arguments.done", 2), ("output_item.done", 2),
    ]  # fmt: skip
    message, first, second = events.items
    assert message["content"][0]["text"] == "Hello" and seen[5]["text"] == "Hello"
    assert seen[3]["item_id"] == message["id"] == seen[7]["item"]["id"]
    assert (first["call_id"], first["name"], first["arguments"]) == ("call_1", "f", '{"a": 1}')
    assert seen[11]["arguments"] == '{"a": 1}' and seen[11]["name"] == "f"
    assert seen[8]["item"]["arguments"] == "" and seen[8]["item"]["status"] == "in_progress"
    assert (second["call_id"], second["arguments"], second["status"]) == ("call_2", "{}", "completed")


def test_finish_closes_the_last_item_or_gives_an_empty_message() -> None:
    events = ResponseEvents()
    seen = events_of(events.finish())  # nothing was written
    kinds = [e["type"].removeprefix("response.") for e in seen]
    assert kinds == [
        "output_item.added", "content_part.added", "output_text.done", "content_part.done", "output_item.done"
    ]  # fmt: skip
    assert events.items == [{**events.items[0], "type": "message", "status": "completed"}]
    assert events.items[0]["content"][0]["text"] == ""
    assert [e["content_index"] for e in seen if "content_index" in e] == [0, 0, 0]

    written = ResponseEvents()
    written.delta({"content": "Hi"})
    closing = events_of(written.finish())
    assert [e["type"] for e in closing][-1] == "response.output_item.done" and len(written.items) == 1
    assert written.items[0]["content"][0]["text"] == "Hi" and written.finish() == []


def test_text_after_a_call_opens_a_new_message_and_empty_pieces_say_nothing() -> None:
    events = ResponseEvents()
    events.delta(tool_delta(0, "{}", name="f"))
    assert events.delta(tool_delta(0, "")) == [] and events.delta({"content": ""}) == []
    seen = events_of(events.delta({"content": "done"}) + events.close())
    assert [e["type"] for e in seen][:5] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    call, message = events.items
    assert call["arguments"] == "{}" and message["content"][0]["text"] == "done"
    assert all(e["content_index"] == 0 for e in seen if "content_index" in e)


def test_output_items_text_then_calls() -> None:
    call = chat_call("call_a", "Paris")
    assert [i["type"] for i in output_items("Looking.", [call])] == ["message", "function_call"]
    assert [i["type"] for i in output_items(None, [call])] == ["function_call"]
    (empty,) = output_items(None, [])
    assert empty["content"][0]["text"] == "" and empty["id"].startswith("msg_")
    (item,) = output_items(None, [call])
    assert item["id"].startswith("fc_") and item["id"] != "fc_"
    assert (item["call_id"], item["name"], item["status"]) == ("call_a", "get_weather", "completed")
    assert json.loads(item["arguments"]) == {"city": "Paris"}


def test_the_response_object_echoes_the_request() -> None:
    plain = ResponseShell(ResponsesRequest.model_validate({"input": "x"}), "m").body("completed", [], None)
    assert (plain["temperature"], plain["top_p"], plain["tool_choice"], plain["metadata"]) == (
        1.0,
        1.0,
        "auto",
        {},
    )
    assert (plain["background"], plain["store"], plain["incomplete_details"], plain["error"]) == (
        False,
        False,
        None,
        None,
    )
    assert plain["text"] == {"format": {"type": "text"}} and plain["tools"] == [] and plain["model"] == "m"
    schema = {"type": "object"}
    asked = ResponsesRequest.model_validate(
        {
            "input": "x", "temperature": 0.3, "top_p": 0.5, "tool_choice": "required", "metadata": {"k": "v"},
            "tools": [{"type": "function", "name": "f"}], "max_output_tokens": 9, "instructions": "I",
            "text": {"format": {"type": "json_schema", "name": "n", "schema": schema}}, "user": "u",
        }
    )  # fmt: skip
    body = ResponseShell(asked, "m").body("incomplete", [], None)
    assert (body["temperature"], body["top_p"], body["tool_choice"], body["metadata"]) == (
        0.3,
        0.5,
        "required",
        {"k": "v"},
    )
    assert body["tools"] == [{"type": "function", "name": "f"}]  # no nulls for what was not sent
    assert body["text"] == {"format": {"type": "json_schema", "name": "n", "schema": schema}}
    text = ResponsesRequest.model_validate({"input": "x", "text": {"format": {"type": "text"}}})
    assert ResponseShell(text, "m").body("completed", [], None)["text"] == {"format": {"type": "text"}}
    assert (body["max_output_tokens"], body["instructions"], body["user"]) == (9, "I", "u")
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert ResponseShell(asked, "m").body("failed", [], None)["incomplete_details"] is None


def output(text_delta: str, finish: str | None = None, cached: int = 0) -> RequestOutput:
    piece = CompletionOutput(
        0, text=text_delta, token_ids=[1, 2], text_delta=text_delta, finish_reason=finish
    )
    metrics = RequestMetrics(0.0, num_cached_tokens=cached)
    return RequestOutput("r", [5, 6, 7], [piece], finish is not None, metrics)


async def collect(stream: Any) -> list[dict[str, Any]]:
    return events_of([chunk async for chunk in stream])


def test_usage_counts_prompt_output_and_cached_tokens() -> None:
    usage = response_usage(output("ab", "stop", cached=2))
    assert usage == {
        "input_tokens": 3,
        "input_tokens_details": {"cached_tokens": 2},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 5,
    }


def test_an_engine_error_mid_stream_is_an_error_event_then_failed() -> None:
    """After the 200 went out, an engine error (a request failed inside a step) is said in the stream:
    an `error` event with its code, then `response.failed` holding what was written; the stream closes."""
    closed: list[bool] = []

    async def engine() -> AsyncIterator[RequestOutput]:
        try:
            yield output(" more")
            raise APIError("internal", "the step failed", code="engine_error")
        finally:
            closed.append(True)

    stream = engine()
    started = StartedChat(stream, output("Hi"), plan_tools(None, None), None, "m")
    serving = ResponsesServing.__new__(ResponsesServing)
    shell = ResponseShell(ResponsesRequest.model_validate({"input": "x", "stream": True}), "m")
    seen = asyncio.run(collect(serving._stream(started, shell)))
    kinds = [e["type"] for e in seen]
    assert kinds[-2:] == ["error", "response.failed"] and "response.completed" not in kinds
    error, failed = seen[-2]["code"], seen[-1]["response"]
    assert (error, seen[-2]["message"]) == ("engine_error", "the step failed")
    assert failed["status"] == "failed" and failed["error"] == {
        "code": "engine_error",
        "message": "the step failed",
    }
    assert closed == [True]


def test_a_finished_stream_ends_completed_or_incomplete() -> None:
    for finish, status in (("stop", "completed"), ("length", "incomplete")):

        async def engine(finish: str = finish) -> AsyncIterator[RequestOutput]:
            yield output("lo", finish)

        started = StartedChat(engine(), output("Hel"), plan_tools(None, None), None, "m")
        shell = ResponseShell(ResponsesRequest.model_validate({"input": "x", "stream": True}), "m")
        seen = asyncio.run(collect(ResponsesServing.__new__(ResponsesServing)._stream(started, shell)))
        assert seen[-1]["type"] == f"response.{status}"
        assert seen[-1]["response"]["output"][0]["content"][0]["text"] == "Hello"
        assert seen[-1]["response"]["usage"]["total_tokens"] == 5


def test_a_field_the_chat_api_refuses_names_the_first_and_is_counted() -> None:
    """A check that only the chat request makes (a function's name pattern): a 400 naming the first
    offending field, counted as an invalid request."""
    counted: list[str] = []
    metrics = SimpleNamespace(count_error=counted.append)
    serving = ResponsesServing(SimpleNamespace(client=SimpleNamespace(metrics=metrics)))  # type: ignore[arg-type]
    tools = [{"type": "function", "name": "bad name"}, {"type": "function", "name": "worse name"}]
    request = ResponsesRequest.model_validate({"input": "x", "tools": tools})
    with pytest.raises(APIError) as raised:
        OpenAIServing.translated_chat(serving.serving, request.chat_request)  # type: ignore[arg-type]
    assert (raised.value.kind, raised.value.param) == ("invalid_request", "tools.0.function.name")
    assert raised.value.message.startswith("tools.0.function.name: ") and counted == ["invalid_request"]
