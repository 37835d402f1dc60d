"""`POST /v1/messages` (Anthropic's Messages API) on the embedded SmolLM2-135M through a real
`pagoda serve`, with the official `anthropic` client.

A Messages request runs as the chat request it means, so greedy text, token counts and tool calls are
checked against the chat API's own answers to the same conversation.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from pagoda.service.serve_process import ServeProcess

PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER: Any = {"name": "get_weather", "description": "The weather.", "input_schema": PARAMETERS}
CHAT_WEATHER: Any = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather.", "parameters": PARAMETERS},
}
ASK = "What is the weather in Paris?"
# The client (anthropic 2.x) has dropped the sampling arguments; the API, and this server, still read
# them from the body.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(smollm2_server: ServeProcess) -> ServeProcess:
    return smollm2_server  # tests/conftest.py: one server per worker, shared with the other API modules


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(server: ServeProcess) -> str:
    return str(httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]["id"])


def chat(server: ServeProcess, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_text_streamed_and_not_is_the_chat_completions_text(
    server: ServeProcess, client: anthropic.Anthropic, model: str
) -> None:
    """A system prompt and a user turn: the chat API's greedy text and token counts; the stream's
    deltas add up to it, its events in Anthropic's order; max_tokens cuts it with its stop reason."""
    messages: Any = [{"role": "user", "content": "Name a fruit."}]
    system = [{"type": "text", "text": "Answer briefly."}, {"type": "text", "text": "Be kind."}]
    reference = chat(
        server,
        {
            "model": model,
            "messages": [{"role": "system", "content": "Answer briefly.\nBe kind."}, *messages],
            "max_tokens": 24,
            "temperature": 0,
        },
    )
    kwargs: Any = dict(model=model, system=system, messages=messages, max_tokens=24, extra_body=GREEDY)
    made = client.messages.create(**kwargs)
    text = reference["choices"][0]["message"]["content"]
    assert [b.type for b in made.content] == ["text"] and made.content[0].text == text  # type: ignore[union-attr]
    assert made.id.startswith("msg_") and made.role == "assistant" and made.model == model
    assert made.usage.input_tokens == reference["usage"]["prompt_tokens"]
    assert made.usage.output_tokens == reference["usage"]["completion_tokens"]
    finish = reference["choices"][0]["finish_reason"]
    assert made.stop_reason == ("max_tokens" if finish == "length" else "end_turn")

    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert kinds[1] == "content_block_start" and "content_block_stop" in kinds, kinds
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]  # type: ignore[union-attr]
    assert "".join(deltas) == text and final.content[0].text == text  # type: ignore[union-attr]
    assert final.usage.input_tokens == made.usage.input_tokens
    assert final.usage.output_tokens == made.usage.output_tokens and final.stop_reason == made.stop_reason

    cut = client.messages.create(**{**kwargs, "max_tokens": 3})
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    assert text.startswith(cut.content[0].text)  # type: ignore[union-attr]


def test_a_stop_sequence_is_named(client: anthropic.Anthropic, model: str) -> None:
    messages: Any = [{"role": "user", "content": "Count from one to ten in words."}]
    whole = client.messages.create(model=model, messages=messages, max_tokens=40, extra_body=GREEDY)
    text = whole.content[0].text  # type: ignore[union-attr]
    # Three characters from the middle that occur there first: the text stops just before them.
    at = next(i for i in range(len(text) // 2, len(text) - 3) if text.index(text[i : i + 3]) == i)
    word = text[at : at + 3]
    cut = client.messages.create(
        model=model, messages=messages, max_tokens=40, extra_body=GREEDY, stop_sequences=[word]
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word, cut
    assert cut.content[0].text == text[:at]  # type: ignore[union-attr]


def test_tool_use_and_its_result_round_trip(
    server: ServeProcess, client: anthropic.Anthropic, model: str
) -> None:
    """tool_choice any: tool_use blocks that validate against the tool, streamed or not the same;
    sent back with their results, the turns count as the chat render of the same conversation."""
    kwargs: Any = dict(
        model=model,
        messages=[{"role": "user", "content": ASK}],
        tools=[WEATHER],
        tool_choice={"type": "any"},
        max_tokens=80,
        extra_body=GREEDY,
    )
    made = client.messages.create(**kwargs)
    uses = [b for b in made.content if b.type == "tool_use"]
    assert uses and made.stop_reason == "tool_use", made
    for use in uses:
        assert use.name == "get_weather"
        jsonschema.validate(use.input, PARAMETERS)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (u.name, u.input) for u in uses
    ]
    started = [e.content_block for e in events if e.type == "content_block_start"]  # type: ignore[union-attr]
    assert [b.type for b in started] == ["tool_use"] * len(uses)

    results: Any = [{"type": "tool_result", "tool_use_id": u.id, "content": "18 C"} for u in uses]
    conversation: Any = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [u.model_dump() for u in uses]},
        {"role": "user", "content": results},
    ]
    counted = client.messages.count_tokens(model=model, messages=conversation, tools=[WEATHER])
    chat_calls = [
        {"id": u.id, "type": "function", "function": {"name": u.name, "arguments": json.dumps(u.input)}}
        for u in uses
    ]
    chat_messages = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": chat_calls},
        *({"role": "tool", "tool_call_id": u.id, "content": "18 C"} for u in uses),
    ]
    rendered = httpx.post(
        f"{server.base_url}/v1/chat/completions/render",
        json={"model": model, "messages": chat_messages, "tools": [CHAT_WEATHER]},
        timeout=60,
    )
    assert rendered.status_code == 200, rendered.text
    assert counted.input_tokens == len(rendered.json()["token_ids"])
    answer = client.messages.create(
        model=model, messages=conversation, tools=[WEATHER], max_tokens=6, extra_body=GREEDY
    )
    assert answer.content and answer.content[0].type == "text"


def test_a_named_tool_streams_its_input_piece_by_piece(client: anthropic.Anthropic, model: str) -> None:
    kwargs: Any = dict(
        model=model,
        messages=[{"role": "user", "content": ASK}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=80,
        extra_body=GREEDY,
    )
    with client.messages.stream(**kwargs) as stream:
        pieces = [e.delta.partial_json for e in stream if e.type == "content_block_delta"]  # type: ignore[union-attr]
        final = stream.get_final_message()
    [use] = [b for b in final.content if b.type == "tool_use"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == use.input
    jsonschema.validate(use.input, PARAMETERS)
    # Cut short by max_tokens, the call's arguments are no JSON object: the model's text, not a 500.
    cut = client.messages.create(**{**kwargs, "max_tokens": 3})
    assert cut.stop_reason == "max_tokens" and [b.type for b in cut.content] == ["text"], cut
    assert "".join(pieces).startswith(cut.content[0].text)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "param_word"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"messages": [{"role": "system", "content": "hi"}]}, "role"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
    ],
)
def test_what_it_cannot_do_is_a_clear_error_in_anthropics_shape(
    server: ServeProcess, model: str, body: dict[str, Any], param_word: str
) -> None:
    request = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **body}
    response = httpx.post(f"{server.base_url}/v1/messages", json=request, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert param_word in error["error"]["message"], error
    assert httpx.get(f"{server.base_url}/v1/health/ready", timeout=10).status_code == 200


def test_the_anthropic_client_raises_the_servers_reasons(client: anthropic.Anthropic, model: str) -> None:
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=None)  # type: ignore[arg-type]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(
            model="no-such-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
