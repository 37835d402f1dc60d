"""Anthropic's Messages request as the chat request it means, and its content blocks and stream events,
without a server (tests/test_serve_messages.py runs them through a real `pagoda serve` and the
`anthropic` client)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from pagoda.service.api.engine_client import APIError
from pagoda.service.api.messages_protocol import CountTokensRequest, MessagesRequest
from pagoda.service.api.messages_serving import (
    MessageEvents,
    MessagesServing,
    content_blocks,
    error_body,
    message_usage,
    stop_reason,
)
from pagoda.service.api.openai_serving import OpenAIServing, StartedChat
from pagoda.service.api.tool_calls import plan_tools
from pagoda.service.errors import InvalidRequestError
from pagoda.service.outputs import CompletionOutput, RequestMetrics, RequestOutput

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": SCHEMA}


def chat(**body: Any) -> dict[str, Any]:
    request = MessagesRequest.model_validate({"max_tokens": 16, **body})
    return request.chat_request().model_dump(exclude_none=True)


def refused(**body: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as raised:
        chat(**body)
    return raised.value


def test_system_blocks_and_text_turns() -> None:
    got = chat(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
    )
    assert got["messages"] == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    assert chat(system="S", messages=[{"role": "user", "content": "x"}])["messages"][0] == {
        "role": "system",
        "content": "S",
    }
    assert chat(messages=[{"role": "user", "content": "x"}])["messages"] == [{"role": "user", "content": "x"}]


def test_sampling_fields_reach_the_chat_request() -> None:
    got = chat(
        messages=[{"role": "user", "content": "x"}],
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=3,
        stop_sequences=["END"],
        seed=11,
        metadata={"user_id": "u"},
    )
    assert (got["max_completion_tokens"], got["temperature"], got["top_p"]) == (7, 0.5, 0.9)
    assert (got["top_k"], got["stop"], got["seed"]) == (3, ["END"], 11)
    params = MessagesRequest.model_validate(
        {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "top_k": 3}
    ).chat_request()
    assert params.sampling_params().top_k == 3 and params.sampling_params().max_tokens == 5


def test_tool_use_and_tool_results_become_calls_and_tool_turns() -> None:
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    got = chat(
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Let me look."},
                    use,
                    {**use, "id": "toolu_2", "input": {"city": "Lyon"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "20 C"}],
                    },
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    )
    assert got["messages"][1] == {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "toolu_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "toolu_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
            },
        ],
    }
    assert got["messages"][2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "20 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert got["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city.",
                "parameters": SCHEMA,
            },
        }
    ]
    calls_only = chat(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": [use]}])
    assert "content" not in calls_only["messages"][1] and calls_only["messages"][1]["tool_calls"]
    results_only = chat(
        messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]
    )
    assert results_only["messages"] == [{"role": "tool", "tool_call_id": "t", "content": "ok"}]
    assert chat(messages=[{"role": "user", "content": []}])["messages"] == [{"role": "user", "content": ""}]


@pytest.mark.parametrize(
    ("choice", "tool_choice", "parallel"),
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "none"}, "none", True),
        ({"type": "any"}, "required", True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        (
            {"type": "tool", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
            True,
        ),
    ],
)
def test_tool_choice(choice: dict[str, Any], tool_choice: Any, parallel: bool) -> None:
    got = chat(messages=[{"role": "user", "content": "x"}], tools=[WEATHER], tool_choice=choice)
    assert (got["tool_choice"], got["parallel_tool_calls"]) == (tool_choice, parallel)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": []}, "messages", "at least one"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role", "user or assistant"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content", "string or a list"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages.0.content.0.type",
            "image",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "document"}]}]},
            "messages.0.content.0.type",
            "document",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            "messages.0.content.0.text",
            "string",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}]},
            "messages.0.content.1.text",
            "string",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
            "messages.0.content.0",
            "tool_use_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}
                        ],
                    }
                ]
            },
            "messages.0.content.0.content.0.type",
            "image",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}],
                    }
                ]
            },
            "messages.0.content.0",
            "object",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "input": {}}]}]},
            "messages.0.content.0",
            "name",
        ),
        ({"system": [{"type": "image"}]}, "system.0.type", "image"),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "tools.0.type",
            "web_search_20250305",
        ),
        ({"tools": [{"description": "no name"}]}, "tools.0.name", "name"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice", "tool_choice"),
        ({"tool_choice": {"type": "required"}}, "tool_choice", "tool_choice"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking", "thinking"),
        ({"thinking": {"type": "adaptive"}}, "thinking", "thinking"),
        # Types that sort before or after the ones taken are refused all the same.
        ({"tool_choice": {"type": "aaa"}}, "tool_choice", "tool_choice"),
        ({"tool_choice": {"type": "tom", "name": "get_weather"}}, "tool_choice", "tool_choice"),
        ({"tool_choice": {"type": "zzz", "name": "get_weather"}}, "tool_choice", "tool_choice"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
                ]
            },
            "messages.0.content.0.type",
            "tool_use",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "video"}]}]},
            "messages.0.content.0.type",
            "video",
        ),
        ({"system": [{"type": "tool_use"}]}, "system.0.type", "tool_use"),
        ({"mcp_servers": [{"type": "url", "url": "https://x"}]}, "mcp_servers", "mcp_servers"),
        ({"container": "c"}, "container", "container"),
    ],
)
def test_what_it_cannot_take_is_refused_by_name(body: dict[str, Any], param: str, words: str) -> None:
    error = refused(**{"messages": [{"role": "user", "content": "x"}], **body})
    assert error.param == param and words in str(error), (error.param, str(error))


def test_custom_tools_and_disabled_thinking_are_taken() -> None:
    got = chat(
        messages=[{"role": "user", "content": "x"}],
        tools=[{**WEATHER, "type": "custom"}],
        thinking={"type": "disabled"},
        service_tier="auto",
    )
    assert got["tools"][0]["function"]["name"] == "get_weather"


def test_tool_inputs_keep_their_characters_and_requests_default_to_unstreamed() -> None:
    use = {"type": "tool_use", "id": "t", "name": "f", "input": {"city": "Zürich"}}
    got = chat(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": [use]}])
    assert got["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Zürich"}'
    assert MessagesRequest.model_validate({"max_tokens": 1, "messages": []}).stream is False


def test_count_tokens_needs_no_max_tokens() -> None:
    request = CountTokensRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert request.chat_request().max_completion_tokens is None
    with pytest.raises(ValueError, match="max_tokens"):
        MessagesRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})


def output(text_delta: str, finish: str | None = None, stop: str | int | None = None) -> RequestOutput:
    piece = CompletionOutput(
        0, text=text_delta, token_ids=[1, 2], text_delta=text_delta, finish_reason=finish, stop_reason=stop
    )
    return RequestOutput(
        "r", [5, 6, 7], [piece], finish is not None, RequestMetrics(0.0, num_cached_tokens=2)
    )


def test_stop_reasons() -> None:
    assert stop_reason(output("a", "length"), has_calls=True) == ("max_tokens", None)
    assert stop_reason(output("a", "stop"), has_calls=True) == ("tool_use", None)
    assert stop_reason(output("a", "stop", stop="END"), has_calls=False) == ("stop_sequence", "END")
    assert stop_reason(output("a", "stop", stop=2), has_calls=False) == ("end_turn", None)
    assert stop_reason(output("a", "stop"), has_calls=False) == ("end_turn", None)


def test_blocks_usage_and_errors() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    empty = {**call, "function": {"name": "g", "arguments": ""}}
    assert content_blocks("Hi", [call, empty]) == [
        {"type": "text", "text": "Hi"},
        {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}},
        {"type": "tool_use", "id": "call_1", "name": "g", "input": {}},
    ]
    assert content_blocks("", []) == [] and content_blocks(None, [call])[0]["type"] == "tool_use"
    # Arguments max_tokens cut short, or JSON that is no object: the model's text, not a call.
    cut = {**call, "function": {"name": "f", "arguments": '{"a": '}}
    listed = {**call, "function": {"name": "f", "arguments": "[1]"}}
    assert content_blocks(None, [cut]) == [{"type": "text", "text": '{"a": '}]
    assert content_blocks("Hi ", [call, listed]) == [
        {"type": "text", "text": "Hi [1]"},
        {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}},
    ]
    assert message_usage(output("a", "stop")) == {
        "input_tokens": 3,
        "output_tokens": 2,
        "cache_read_input_tokens": 2,
        "cache_creation_input_tokens": 0,
    }
    assert error_body(404, "no") == {"type": "error", "error": {"type": "not_found_error", "message": "no"}}
    assert error_body(503, "busy")["error"]["type"] == "overloaded_error"
    statuses = {401: "authentication_error", 403: "permission_error", 413: "request_too_large"}
    for status, kind in {**statuses, 429: "rate_limit_error"}.items():
        assert error_body(status, "x")["error"]["type"] == kind, status
    assert error_body(500, "x")["error"]["type"] == "api_error"
    assert error_body(400, "x")["error"]["type"] == "invalid_request_error"


def events_of(chunks: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for chunk in chunks:
        head, data = chunk.decode().removesuffix("\n\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        out.append(event)
    return out


def test_deltas_become_blocks_opened_and_closed_in_order() -> None:
    events = MessageEvents()
    chunks = events.delta({"content": "Hi"}) + events.delta({"content": "!"}) + events.delta({"content": ""})
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    chunks += events.delta({"tool_calls": [call]})
    chunks += events.delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]})
    chunks += events.delta({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]})
    second = {**call, "id": "call_2", "function": {"name": "g", "arguments": "{}"}}
    chunks += events.delta({"tool_calls": [second]}) + events.close() + events.close()
    seen = events_of(chunks)
    assert [(e["type"], e.get("index")) for e in seen] == [
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
    ]
    assert seen[0]["content_block"] == {"type": "text", "text": ""}
    assert [e["delta"] for e in seen[1:3]] == [{"type": "text_delta", "text": t} for t in ("Hi", "!")]
    assert seen[4]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}
    assert [e["delta"] for e in seen[5:7]] == [
        {"type": "input_json_delta", "partial_json": p} for p in ('{"a"', ": 1}")
    ]
    assert seen[8]["content_block"]["name"] == "g" and seen[9]["delta"]["partial_json"] == "{}"
    assert events.has_calls
    # Text after two calls is the third block, numbered so.
    later = MessageEvents()
    later.delta({"tool_calls": [call]})
    later.delta({"tool_calls": [second]})
    [stop, start, delta] = events_of(later.delta({"content": "ok"}))
    assert (stop["index"], start["index"], delta["index"]) == (1, 2, 2)
    text_only = MessageEvents()
    text_only.delta({"content": "x"})
    assert not text_only.has_calls
    # Text after one call is the second block; arguments with no call open (no id seen, or text open
    # since) go nowhere.
    after_one = MessageEvents()
    after_one.delta({"tool_calls": [call]})
    [stop, start, delta] = events_of(after_one.delta({"content": "ok"}))
    assert (stop["index"], start["index"], delta["index"]) == (0, 1, 1)
    orphan = {"index": 0, "function": {"arguments": "{}"}}
    assert (
        after_one.delta({"tool_calls": [orphan]}) == []
        and MessageEvents().delta({"tool_calls": [orphan]}) == []
    )


async def collect(stream: Any) -> list[dict[str, Any]]:
    return events_of([chunk async for chunk in stream])


def test_a_stream_starts_with_the_prompt_and_ends_with_its_stop_reason() -> None:
    async def engine() -> AsyncIterator[RequestOutput]:
        yield output("lo", "stop", stop="END")

    started = StartedChat(engine(), output("Hel"), plan_tools(None, None), None, "m")
    seen = asyncio.run(collect(MessagesServing.__new__(MessagesServing)._stream(started, "msg_1")))
    assert [e["type"] for e in seen] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = seen[0]["message"]
    assert (start["id"], start["model"], start["content"], start["stop_reason"]) == ("msg_1", "m", [], None)
    assert start["usage"] == {"input_tokens": 3, "output_tokens": 0} and start["role"] == "assistant"
    assert seen[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert seen[-2]["usage"] == {"output_tokens": 2}


def test_an_engine_error_mid_stream_is_an_error_event_and_the_end() -> None:
    closed: list[bool] = []

    async def engine() -> AsyncIterator[RequestOutput]:
        try:
            yield output(" more")
            raise APIError("internal", "the step failed", code="engine_error")
        finally:
            closed.append(True)

    started = StartedChat(engine(), output("Hi"), plan_tools(None, None), None, "m")
    seen = asyncio.run(collect(MessagesServing.__new__(MessagesServing)._stream(started, "msg_1")))
    assert seen[-1] == {"type": "error", "error": {"type": "api_error", "message": "the step failed"}}
    assert "message_stop" not in [e["type"] for e in seen] and closed == [True]


def test_a_field_the_chat_api_refuses_names_the_first_and_is_counted() -> None:
    counted: list[str] = []
    metrics = SimpleNamespace(count_error=counted.append)
    serving = MessagesServing(SimpleNamespace(client=SimpleNamespace(metrics=metrics)))  # type: ignore[arg-type]
    tools = [{"name": "bad name"}, {"name": "worse name"}]
    request = MessagesRequest.model_validate(
        {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": tools}
    )
    with pytest.raises(APIError) as raised:
        OpenAIServing.translated_chat(serving.serving, request.chat_request)  # type: ignore[arg-type]
    assert (raised.value.kind, raised.value.param) == ("invalid_request", "tools.0.function.name")
    assert counted == ["invalid_request"]
    bad = MessagesRequest.model_validate({"max_tokens": 4, "messages": []})
    with pytest.raises(APIError) as raised:
        OpenAIServing.translated_chat(serving.serving, bad.chat_request)  # type: ignore[arg-type]
    assert (raised.value.param, counted) == ("messages", ["invalid_request"] * 2)
