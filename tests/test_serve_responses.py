"""`POST /v1/responses` on the embedded SmolLM2-135M through a real `pagoda serve`, with the official
`openai` client and the OpenAI Agents SDK (whose default model calls this endpoint).

A Responses request runs as the chat request it means, so greedy output, token counts and tool calls
are checked against the chat API's own answers to the same conversation.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pagoda.service.serve_process import ServeProcess

PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather.",
    "parameters": PARAMETERS,
}
CHAT_WEATHER: Any = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
IMAGE = {"type": "input_image", "image_url": "https://example.com/a.png"}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(smollm2_server: ServeProcess) -> ServeProcess:
    return smollm2_server  # tests/conftest.py: one server per worker, shared with the other API modules


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_text_streamed_and_not_is_the_chat_completions_text(client: openai.OpenAI, model: str) -> None:
    """Instructions and input as the chat's system and user turns: the same greedy text and token
    counts; the stream's deltas add up to it, its events numbered in order, cut by max_output_tokens."""
    messages: Any = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a fruit."},
    ]
    common: dict[str, Any] = dict(
        model=model, instructions="Answer briefly.", input="Name a fruit.", temperature=0
    )

    def chat() -> Any:
        return client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)

    def streamed() -> list[Any]:
        return list(client.responses.create(max_output_tokens=12, stream=True, **common))

    with ThreadPoolExecutor(4) as pool:  # at once: one batch
        futures = [
            pool.submit(chat),
            pool.submit(lambda: client.responses.create(max_output_tokens=12, **common)),
            pool.submit(streamed),
            pool.submit(lambda: client.responses.create(max_output_tokens=3, **common)),
        ]
        expected, response, events, cut = (f.result() for f in futures)
    text = expected.choices[0].message.content
    assert text and response.output_text == text
    assert response.model == model and response.object == "response" and response.id.startswith("resp_")
    assert response.usage is not None and expected.usage is not None
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.usage.output_tokens == expected.usage.completion_tokens
    assert response.usage.total_tokens == expected.usage.total_tokens
    assert response.output[0].type == "message" and response.output[0].id.startswith("msg_")
    finished = expected.choices[0].finish_reason
    assert response.status == ("completed" if finished == "stop" else "incomplete")

    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text and kinds[-1] == f"response.{response.status}"
    assert events[-1].response.output_text == text

    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage is not None and cut.usage.output_tokens == 3 and text.startswith(cut.output_text)


def test_function_calls_and_their_outputs_round_trip(
    server: ServeProcess, client: openai.OpenAI, model: str
) -> None:
    """A required call's items validate against the tool; sent back with the tool's output, they are
    the turns the chat template renders (the token count of the chat API's render of them)."""
    kwargs: dict[str, Any] = dict(
        model=model, input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=80, temperature=0
    )
    with ThreadPoolExecutor(2) as pool:  # at once: one batch
        whole = pool.submit(lambda: client.responses.create(**kwargs))
        events = pool.submit(lambda: list(client.responses.create(stream=True, **kwargs)))
        first, streamed = whole.result(), events.result()
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed" and first.incomplete_details is None
    # Streamed, a required call comes whole once the array is complete: the same calls (greedy).
    added = [e.item for e in streamed if e.type == "response.output_item.added"]
    assert [(i.type, i.name) for i in added] == [("function_call", c.name) for c in calls]
    final = streamed[-1].response.output
    assert [(c.name, c.arguments) for c in final] == [(c.name, c.arguments) for c in calls]  # type: ignore[union-attr]
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        assert (call.id or "").startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "18 C"} for c in calls]
    items: Any = [
        {"role": "user", "content": ASK},
        *(c.model_dump(exclude_none=True) for c in calls),
        *outputs,
    ]
    answer = client.responses.create(
        model=model, input=items, tools=[WEATHER], max_output_tokens=6, temperature=0
    )
    assert answer.output[0].type == "message" and answer.output_text

    chat_calls = [
        {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]
    messages = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": chat_calls},
        *({"role": "tool", "tool_call_id": c.call_id, "content": "18 C"} for c in calls),
    ]
    rendered = httpx.post(
        f"{server.base_url}/v1/chat/completions/render",
        json={"model": model, "messages": messages, "tools": [CHAT_WEATHER]},
        timeout=60,
    )
    assert rendered.status_code == 200, rendered.text
    token_ids = rendered.json()["token_ids"]
    assert answer.usage is not None and answer.usage.input_tokens == len(token_ids)
    # vLLM's render of the Responses request itself (routers key prefix affinity on it): the same ids.
    body = {"model": model, "input": items, "tools": [WEATHER]}
    own = httpx.post(f"{server.base_url}/v1/responses/render", json=body, timeout=60)
    assert own.status_code == 200 and own.json()["token_ids"] == token_ids, own.text


def test_a_named_call_streams_its_arguments(client: openai.OpenAI, model: str) -> None:
    choice: Any = {"type": "function", "name": "get_weather"}
    kwargs: dict[str, Any] = dict(model=model, input=ASK, tools=[WEATHER], tool_choice=choice, temperature=0)
    whole = client.responses.create(max_output_tokens=60, **kwargs)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    with client.responses.stream(max_output_tokens=60, **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(pieces) > 1 and "".join(pieces) == done.arguments == call.arguments  # greedy: the same call
    (streamed_call,) = final.output
    assert streamed_call.type == "function_call" and streamed_call.arguments == call.arguments
    assert streamed_call.call_id == added.item.call_id


def test_a_json_schema_text_format_constrains_the_text(client: openai.OpenAI, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"fruit": {"type": "string", "maxLength": 12}, "count": {"type": "integer"}},
        "required": ["fruit", "count"],
        "additionalProperties": False,
    }
    text: Any = {"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}}
    response = client.responses.create(
        model=model, input="A fruit and a count.", text=text, max_output_tokens=60
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"previous_response_id": "resp_1"}, 400, "previous_response_id"),
        ({"input": [{"role": "user", "content": [IMAGE]}]}, 400, "input.0.content.0.type"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
        ({"tools": [{"type": "function", "name": "not a name"}]}, 400, "tools.0.function.name"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, 400, "tool_choice"),
        ({"max_output_tokens": 0}, 400, "max_tokens"),
        ({"input": 7}, 400, "input"),
        ({"model": "nope"}, 404, "model"),
    ],
)  # fmt: skip
def test_what_it_cannot_do_is_a_clear_error(
    server: ServeProcess, body: dict[str, Any], status: int, param: str
) -> None:
    answer = httpx.post(f"{server.base_url}/v1/responses", json={"input": "hi", **body}, timeout=30)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param) and error["message"]
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200


def test_the_openai_agents_sdk_runs_a_tool_and_answers(server: ServeProcess, model: str) -> None:
    """The Agents SDK's default model (Responses): a required tool call is run by the SDK, whose
    result ends the run; an agent with a typed output gets one (its schema is the text format)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool

    sdk_client = openai.AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )
    responses_model = OpenAIResponsesModel(model=model, openai_client=sdk_client)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"sunny in {city}"

    agent = Agent(
        name="weather",
        instructions="Use the tool.",
        model=responses_model,
        tools=[get_weather],
        tool_use_behavior="stop_on_first_tool",
        model_settings=ModelSettings(tool_choice="required", max_tokens=60, temperature=0),
    )
    run = RunConfig(tracing_disabled=True)
    result = Runner.run_sync(agent, ASK, run_config=run)
    assert asked and result.final_output == f"sunny in {asked[0]}"

    class Fruit(BaseModel):
        name: str = Field(max_length=12)

    typed = Agent(
        name="fruit", model=responses_model, output_type=Fruit, model_settings=ModelSettings(max_tokens=40)
    )
    answer = Runner.run_sync(typed, "Name a fruit.", run_config=run)
    assert isinstance(answer.final_output, Fruit) and len(answer.final_output.name) <= 12
    usage = answer.context_wrapper.usage
    assert usage.requests == 1 and 0 < usage.output_tokens <= 40
