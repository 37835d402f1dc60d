"""Tool calling and the endpoints vLLM users call, on the embedded SmolLM2-135M through a real
`pagoda serve`, with the official `openai` client and LangChain.

Forced calls (`required`, a named function) are the grammar's doing, so their arguments validate
against the tool's schema even from a 135M model. `auto` depends on the model's training; its parsers
are checked on each family's format without a server in `tests/test_tool_calls.py`.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from pagoda.service.serve_process import ServeProcess

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 16}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
_NESTED: dict[str, Any] = {"type": "string"}
for _ in range(40):  # deeper than the bounds' 32 levels
    _NESTED = {"type": "object", "properties": {"x": _NESTED}, "required": ["x"]}
DEEP = {"type": "function", "function": {"name": "deep", "parameters": _NESTED}}
BOGUS = {"type": "function", "function": {"name": "bogus", "parameters": {"type": "bogus"}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}  # type: ignore[index]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_server: ServeProcess) -> ServeProcess:
    return smollm2_server  # tests/conftest.py: one server per worker, shared with the other API modules


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def assert_valid_call(call: Any, name: str | None = None) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    if name is not None:
        assert call.function.name == name
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments  # type: ignore[no-any-return]


# ---- tool calls --------------------------------------------------------------------------------------------


def test_named_tool_call_validates_streamed_and_not(client: openai.OpenAI, model: str) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    full = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=60, temperature=0
    )
    message = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls" and message.content is None
    (call,) = message.tool_calls or []
    arguments = assert_valid_call(call, "get_weather")

    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            max_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    streamed = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(streamed) == arguments  # greedy: the same call, streamed piece by piece
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]


def test_required_tool_calls_validate_against_their_tool(client: openai.OpenAI, model: str) -> None:
    """Greedy, sampled, sampled and streamed: at once (one batch, a third of the steps), as only each
    call's validity is asserted."""

    def check(temperature: float, stream: bool) -> None:
        kwargs: dict[str, Any] = dict(
            model=model,
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice="required",
            max_tokens=120,
            temperature=temperature,
            seed=7,
        )
        if not stream:
            response = client.chat.completions.create(**kwargs)
            assert response.choices[0].finish_reason == "tool_calls", response
            calls = response.choices[0].message.tool_calls or []
        else:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert calls
        for call in calls:
            assert_valid_call(call)

    with ThreadPoolExecutor(3) as pool:
        for done in [pool.submit(check, *case) for case in ((0.0, False), (1.0, False), (1.0, True))]:
            done.result()


def test_a_following_turn_with_the_tools_result(client: openai.OpenAI, model: str) -> None:
    first = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=80, temperature=0
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    messages: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})},
    ]
    answer = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], max_tokens=12, temperature=0
    )
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage is not None and answer.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


def test_auto_and_none_answer_in_text(client: openai.OpenAI, model: str) -> None:
    def ask(choice: str) -> Any:
        return client.chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=8, temperature=0
        )

    with ThreadPoolExecutor(2) as pool:  # at once: one batch
        responses = list(pool.map(ask, ("auto", "none")))
    for response in responses:
        message = response.choices[0].message
        assert message.content and not message.tool_calls


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"functions": [WEATHER["function"]]}, "functions"),
        # A tool's parameters become the grammar under `required` or a named tool: the grammar bounds
        # and the compile check hold for them too (issue 30), the tool_choice named.
        ({"tools": [DEEP], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [DEEP], "tool_choice": {"type": "function", "function": {"name": "deep"}}}, "tool_choice"),
        ({"tools": [BOGUS], "tool_choice": "required"}, "tool_choice"),
        ({"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}, "audio"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content.0.type",
        ),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(
    server: ServeProcess, model: str, fields: dict[str, Any], param: str
) -> None:
    body = {"model": model, "messages": ASK, "max_tokens": 4, **fields}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    if fields.get("tools") == [DEEP]:
        assert "tool_choice is too complex: nested deeper than 32" in response.json()["error"]["message"]
    if fields.get("tools") == [BOGUS]:
        assert response.json()["error"]["message"].startswith("tool_choice is invalid: ")


@pytest.mark.parametrize(("fields", "param"), [({"suffix": "end"}, "suffix"), ({"best_of": 3}, "best_of")])
def test_completion_parameters_not_honoured_are_a_400(
    client: openai.OpenAI, model: str, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt="Hi", max_tokens=2, **fields)
    assert refused.value.body["param"] == param  # type: ignore[index]
    ok = client.completions.create(model=model, prompt="Hi", max_tokens=2, best_of=1)
    assert ok.choices[0].text is not None


# ---- endpoints ---------------------------------------------------------------------------------------------


def test_tokenize_detokenize_round_trip(server: ServeProcess, model: str) -> None:
    url = server.base_url
    text = "The capital of France is Paris."
    tokens = httpx.post(
        f"{url}/tokenize", json={"model": model, "prompt": text, "return_token_strs": True}
    ).json()
    assert tokens["count"] == len(tokens["tokens"]) > 3 and tokens["max_model_len"] == 1024
    assert "".join(tokens["token_strs"]).endswith("Paris.")
    back = httpx.post(f"{url}/detokenize", json={"model": model, "tokens": tokens["tokens"]}).json()
    assert back["prompt"].endswith(text)
    chat = httpx.post(f"{url}/tokenize", json={"messages": ASK}).json()
    assert chat["count"] > tokens["count"]  # the template's turns around the question
    rendered = httpx.post(f"{url}/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert "What is the weather in Paris?" in rendered and "<|im_start|>assistant" in rendered
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    neither = httpx.post(f"{url}/tokenize", json={"model": model})
    assert neither.status_code == 400


def test_models_retrieve_and_version(server: ServeProcess, client: openai.OpenAI, model: str) -> None:
    retrieved = client.models.retrieve(model)
    assert retrieved.id == model and retrieved.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("not-this-one")
    version = httpx.get(f"{server.base_url}/version").json()["version"]
    assert version and version[0].isdigit()


# ---- LangChain ---------------------------------------------------------------------------------------------


def test_langchain_bind_tools_and_structured_output(server: ServeProcess, model: str) -> None:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)

    llm = ChatOpenAI(
        model=model,
        base_url=f"{server.base_url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=60,
        max_retries=0,
    )
    with ThreadPoolExecutor(2) as pool:  # at once: one batch
        calling = pool.submit(
            llm.bind_tools([WEATHER], tool_choice="get_weather").invoke, "What is the weather in Paris?"
        )
        describing = pool.submit(
            llm.with_structured_output(Person, method="json_schema").invoke, "Describe a person."
        )
        forced, person = calling.result(), describing.result()
    (call,) = forced.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], SCHEMAS["get_weather"])
    assert isinstance(person, Person)


# ---- gRPC --------------------------------------------------------------------------------------------------


def test_grpc_chat_with_tools(server: ServeProcess) -> None:
    import grpc

    from pagoda.service.grpc_gen import inference_pb2 as pb
    from pagoda.service.grpc_gen import inference_pb2_grpc as pb_grpc

    tools = [
        pb.Tool(
            name=t["function"]["name"],  # type: ignore[index]
            parameters_json=json.dumps(t["function"]["parameters"]),  # type: ignore[index]
        )
        for t in (WEATHER, TIME)
    ]
    sampling = pb.SamplingParameters(max_new_tokens=80, temperature=0)
    question = pb.ChatMessage(role="user", content=ASK[0]["content"])
    with grpc.insecure_channel(server.grpc_target) as channel, ThreadPoolExecutor(3) as pool:
        stub = pb_grpc.InferenceStub(channel)

        def generate(chat: Any, sampling: Any) -> list[Any]:
            return list(stub.Generate(pb.GenerateRequest(chat=chat, sampling=sampling), timeout=120))

        # The first request alone fills the prefix cache with the prompt (~300 tokens of tool schemas);
        # the other two, independent of each other, then run at once (one batch) from the cached blocks.
        chats = {
            c: pb.ChatMessages(messages=[question], tools=tools, tool_choice=c)
            for c in ("get_time", "required")
        }
        # A seed whose two choices end apart (8 replies; seed 4's ended in consecutive replies).
        sampled = pb.SamplingParameters(n=2, seed=6, temperature=1.0, max_new_tokens=80)
        running = {"get_time": pool.submit(generate, chats["get_time"], sampling)}
        running["get_time"].result()
        running["required"] = pool.submit(generate, chats["required"], sampling)
        running["n=2"] = pool.submit(generate, chats["get_time"], sampled)
        for choice in ("get_time", "required"):
            replies = running[choice].result()
            final = next(r for r in replies if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED)
            assert final.finish_reason == pb.FINISH_REASON_TOOL_CALLS
            assert all(not r.text for r in replies)  # the call's text is not streamed as text
            assert final.tool_calls
            for call in final.tool_calls:
                assert call.id.startswith("call_")
                jsonschema.validate(json.loads(call.arguments_json), SCHEMAS[call.name])
            if choice == "get_time":
                assert [c.name for c in final.tool_calls] == ["get_time"]
        # n=2: a choice that ends steps before the other (its output is not the request's final one,
        # which alone carries the whole text) still has its whole call parsed.
        replies = running["n=2"].result()
        ends = [i for i, r in enumerate(replies) if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
        assert sorted(replies[i].index for i in ends) == [0, 1]
        assert any(r.token_ids for r in replies[ends[0] + 1 : ends[1]])  # the other went on
        for i in ends:
            assert replies[i].finish_reason == pb.FINISH_REASON_TOOL_CALLS
            (call,) = replies[i].tool_calls
            jsonschema.validate(json.loads(call.arguments_json), SCHEMAS["get_time"])
        # The tool's result in a following turn, and a choice naming no tool.
        follow = pb.ChatMessages(
            messages=[
                question,
                pb.ChatMessage(role="assistant", tool_calls=[final.tool_calls[0]]),
                pb.ChatMessage(role="tool", tool_call_id=final.tool_calls[0].id, content='{"ok": true}'),
            ],
            tools=tools,
        )
        sampling = pb.SamplingParameters(max_new_tokens=6, temperature=0)
        replies = list(stub.Generate(pb.GenerateRequest(chat=follow, sampling=sampling), timeout=120))
        assert replies[-1].usage.completion_tokens > 0
        wrong = pb.ChatMessages(messages=[question], tools=tools, tool_choice="nope")
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(pb.GenerateRequest(chat=wrong, sampling=sampling), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
