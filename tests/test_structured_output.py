"""Structured output and logit_bias on the embedded SmolLM2-135M, through a real `pagoda serve` with the
official `openai` client (and gRPC, and the offline `LLM`).

A 135M model cannot be trusted to write JSON, so valid output here is the grammar's doing: the schema
validates, the regex matches and the choice is one of the choices, greedy or sampled, streamed or not.
Prompts and max_tokens are small: the suite runs on two CPU cores.
"""

from __future__ import annotations

import dataclasses
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest

from pagoda.service.grpc_gen import inference_pb2 as pb
from pagoda.service.grpc_gen import inference_pb2_grpc as pb_grpc
from pagoda.service.serve_process import ServeProcess

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


@pytest.fixture(scope="module")
def server(smollm2_server: ServeProcess) -> ServeProcess:
    return smollm2_server  # tests/conftest.py: one server per worker, shared with the other API modules


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_json_schema_output_validates_streamed_and_not(client: openai.OpenAI, model: str) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    full = client.chat.completions.create(
        model=model, messages=ASK_PERSON, max_tokens=40, temperature=0, response_format=response_format
    )
    choice = full.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content or ""), PERSON)

    stream = client.chat.completions.create(
        model=model,
        messages=ASK_PERSON,
        max_tokens=40,
        temperature=0,
        response_format=response_format,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == choice.message.content

    # Sampled, n=3: every completion validates (each sequence has its own matcher).
    sampled = client.chat.completions.create(
        model=model,
        messages=ASK_PERSON,
        max_tokens=40,
        temperature=1.0,
        seed=7,
        n=3,
        response_format=response_format,
    )
    for c in sampled.choices:
        jsonschema.validate(json.loads(c.message.content or ""), PERSON)


def test_json_object_parses(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Reply with an empty JSON object."}]
    out = client.chat.completions.create(
        model=model, messages=messages, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    assert out.choices[0].finish_reason == "stop", out.choices[0]
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)


def test_guided_choice_regex_json_and_grammar_on_completions(client: openai.OpenAI, model: str) -> None:
    """Six independent requests, at once (one batch); each answer is checked on its own."""
    choices = ["red", "green", "blue"]
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    gbnf = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no"'
    requests: dict[str, dict[str, Any]] = {
        "choice": dict(prompt="My favourite colour is", max_tokens=5, n=4, temperature=1.0, seed=1,
                       extra_body={"guided_choice": choices}),
        # vLLM >= 0.10.2 spells it structured_outputs
        "structured_outputs": dict(prompt="My favourite colour is", max_tokens=5, temperature=0,
                                   extra_body={"structured_outputs": {"choice": choices}}),
        "regex": dict(prompt="Call me at", max_tokens=12, temperature=0,
                      extra_body={"guided_regex": r" [0-9]{3}-[0-9]{4}"}),
        "json": dict(prompt="A person:", max_tokens=40, temperature=0,
                     extra_body={"guided_json": json.dumps(PERSON)}),
        **{name: dict(prompt="Is water wet?", max_tokens=10, temperature=0, extra_body={"guided_grammar": g})
           for name, g in (("lark", lark), ("gbnf", gbnf))},
    }  # fmt: skip
    with ThreadPoolExecutor(len(requests)) as pool:
        running = {k: pool.submit(client.completions.create, model=model, **r) for k, r in requests.items()}
        out = {k: f.result() for k, f in running.items()}
    assert all(c.text in choices for c in out["choice"].choices), [c.text for c in out["choice"].choices]
    assert out["structured_outputs"].choices[0].text in choices
    text = out["regex"].choices[0].text
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", text), text
    jsonschema.validate(json.loads(out["json"].choices[0].text), PERSON)
    for grammar in ("lark", "gbnf"):
        text = out[grammar].choices[0].text
        assert text in ("The answer is yes.", "The answer is no."), text


def test_guided_choice_streamed_in_chat(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=5,
        temperature=0,
        stream=True,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) in ("yes", "no")
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logit_bias_bans_the_greedy_token(client: openai.OpenAI, model: str, smollm2_gguf: Path) -> None:
    from pagoda.service.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(smollm2_gguf)
    prompt = "The capital of France is"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0)
    greedy = tokenizer.encode(plain.choices[0].text, add_special_tokens=False)[0]
    biased = client.completions.create(
        model=model, prompt=prompt, max_tokens=3, temperature=0, logit_bias={str(greedy): -100}
    )
    first = tokenizer.encode(biased.choices[0].text, add_special_tokens=False)[0]
    assert first != greedy and biased.choices[0].text != plain.choices[0].text
    # A positive bias on the banned token's rival is honoured too: +100 makes any token the greedy one.
    forced = tokenizer.encode(" Rome", add_special_tokens=False)[0]
    pushed = client.completions.create(
        model=model, prompt=prompt, max_tokens=1, temperature=0, logit_bias={str(forced): 100}
    )
    assert pushed.choices[0].text == " Rome"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"logit_bias": {"49152": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"json": "[1]"}}, "structured_outputs"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
        # What crashed the server (issue 30), refused before compiling (bounds in service/grammar.py):
        ({"guided_choice": [f"choice {i}" for i in range(100_000)]}, "guided_choice"),
        (
            {"guided_grammar": "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(5000))},
            "guided_grammar",
        ),
        ({"guided_regex": "((a{100}){100}){100}"}, "guided_regex"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "strict": True,
                        "schema": {
                            "allOf": [
                                {
                                    "anyOf": [
                                        {"type": "string", "pattern": f"^[a-z]{{{i}}}$"},
                                        {"type": "integer"},
                                    ]
                                }
                                for i in range(250)
                            ]
                        },
                    },
                }
            },
            "response_format",
        ),
    ],
    ids=lambda value: str(value)[:60] if isinstance(value, dict) else str(value),
)
def test_invalid_constraints_are_400_naming_the_parameter(
    client: openai.OpenAI, model: str, body: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body=body)
    error = info.value.body
    assert isinstance(error, dict) and error.get("param") == param, error


def test_the_server_still_serves_after_bad_grammars(client: openai.OpenAI, model: str) -> None:
    """An invalid grammar never reaches the step loop: plain and constrained requests both go on."""
    for _ in range(2):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(
                model=model, prompt="Hi", max_tokens=2, extra_body={"guided_regex": "("}
            )
    out = client.completions.create(
        model=model, prompt="Hi", max_tokens=2, extra_body={"guided_choice": ["ok"]}
    )
    assert out.choices[0].text == "ok"


def test_constraints_that_leave_no_token_are_a_400_and_the_server_goes_on(
    server: ServeProcess, client: openai.OpenAI, model: str
) -> None:
    """The grammar allows only digits, allowed_token_ids only a word's tokens: no token is possible at
    the first step, and the request is a 400 saying so (streamed too: the headers wait for the first
    token), not a token outside both. A one-digit grammar under min_tokens 3 meets it at the second
    token, after a streamed chunk: an error event with the refusal's type ends the stream. A list
    sharing a token with the grammar is served while the grammar has more to say."""

    def ids(text: str) -> list[int]:
        body = {"model": model, "prompt": text, "add_special_tokens": False}
        return httpx.post(f"{server.base_url}/tokenize", json=body).json()["tokens"]

    conflict = {"guided_regex": "[0-9]{3}", "allowed_token_ids": ids("hello")}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="no next token is possible"):
            client.completions.create(
                model=model, prompt="Hi", max_tokens=4, stream=stream, extra_body=conflict
            )
    chunks = []
    with pytest.raises(openai.APIError, match="no next token is possible") as info:
        for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True,
            extra_body={"guided_regex": "[0-9]", "min_tokens": 3},
        ):  # fmt: skip
            chunks.append(chunk)
    assert isinstance(info.value.body, dict) and info.value.body["type"] == "invalid_request_error"
    assert re.fullmatch("[0-9]", "".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    shared = {"guided_regex": "[0-9]{3}", "allowed_token_ids": ids("hello") + ids("7")}
    out = client.completions.create(model=model, prompt="Hi", max_tokens=3, extra_body=shared)
    assert out.choices[0].text == "777"  # a 4th token would be the grammar's EOS, which the list lacks


def server_token_id(server: ServeProcess, word: str) -> int:
    body = {"prompt": word, "add_special_tokens": False}
    return int(httpx.post(f"{server.base_url}/tokenize", json=body).json()["tokens"][0])


def test_grpc_structured_output_fields(server: ServeProcess) -> None:
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.InferenceStub(channel)

        def generate(**fields: object) -> str:
            sampling = pb.SamplingParameters(temperature=0, max_new_tokens=40, **fields)  # type: ignore[arg-type]
            request = pb.GenerateRequest(text="A person:", sampling=sampling)
            return "".join(r.text for r in stub.Generate(request, timeout=120))

        with ThreadPoolExecutor(4) as pool:  # the four answers at once (one batch), each checked alone
            as_json, chosen, matched, as_object = pool.map(
                lambda fields: generate(**fields),
                [{"json_schema": json.dumps(PERSON)}, {"choice": pb.Choices(choices=["alpha", "beta"])},
                 {"regex": "[a-z]{2,4}"}, {"json_object": True}],
            )  # fmt: skip
        jsonschema.validate(json.loads(as_json), PERSON)
        assert chosen in ("alpha", "beta")
        assert re.fullmatch("[a-z]{2,4}", matched)
        assert isinstance(json.loads(as_object), dict)
        with pytest.raises(grpc.RpcError) as info:
            generate(regex="(")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in (
            info.value.details() or ""
        )
        with pytest.raises(grpc.RpcError) as info:
            generate(logit_bias={10**6: 1.0})
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as info:  # a grammar and allowed ids with nothing in common
            generate(regex="[0-9]{3}", allowed_token_ids=[server_token_id(server, "hello")])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no next token is possible" in (info.value.details() or "")
        for too_much in (
            {"choice": pb.Choices(choices=[f"c{i}" for i in range(100_000)])},
            {"regex": "((a{100}){100}){100}"},
        ):  # the bounds hold over gRPC too: refused before compiling, the field named
            with pytest.raises(grpc.RpcError) as info:
                generate(**too_much)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "is too complex" in (info.value.details() or "") and next(iter(too_much)) in (
                info.value.details() or ""
            )


@pytest.mark.parametrize("is_async", [False, True], ids=["in-turn", "async"])
def test_offline_llm_structured_output_and_logit_bias(is_async: bool) -> None:
    """In turn and with async scheduling (the grammar's bitmask waits for the step before's tokens)."""
    from pagoda.service.errors import InvalidRequestError
    from pagoda.service.grammar import Grammar
    from pagoda.service.llm import LLM
    from pagoda.service.sampling_params import SamplingParams

    with LLM(
        max_model_len=256, kv_cache_memory_bytes=32 << 20, max_num_seqs=8, async_scheduling=is_async
    ) as llm:
        prompts = ["A person:", "Another person:"]
        constrained = SamplingParams(temperature=0, max_tokens=40, grammar=Grammar.json_schema(PERSON))
        plain = SamplingParams(temperature=0, max_tokens=8)
        # One batch mixing a grammar request and a free one: the free one is as it is alone.
        alone = llm.generate(prompts[1], plain)[0].outputs[0].token_ids
        mixed = llm.generate(prompts, [constrained, plain])
        jsonschema.validate(json.loads(mixed[0].outputs[0].text), PERSON)
        assert mixed[1].outputs[0].token_ids == alone

        banned = alone[0]
        biased = llm.generate(
            prompts[1], SamplingParams(temperature=0, max_tokens=1, logit_bias={banned: -100})
        )
        assert biased[0].outputs[0].token_ids[0] != banned

        with pytest.raises(InvalidRequestError) as info:
            llm.generate("x", SamplingParams(grammar=Grammar.regex("(", "guided_regex")))
        assert info.value.param == "guided_regex"

        # Aborted while its grammar compiles (or just after): nothing is left behind, and the engine
        # goes on serving constrained requests.
        engine = llm.engine
        fresh = Grammar.json_schema({"type": "object", "properties": {"k": {"type": "string"}}})
        engine.add_request("aborted", "x", SamplingParams(max_tokens=4, grammar=fresh))
        engine.abort("aborted")
        while engine.has_unfinished:
            engine.step()
        assert not engine.core.structured_output.is_active and not engine.core.has_unfinished
        again = llm.generate(
            "A colour:", SamplingParams(max_tokens=4, grammar=Grammar.choice(["red", "blue"]))
        )
        assert again[0].outputs[0].text in ("red", "blue")

        # A grammar that min_tokens leaves no token (a digit, then only its end, which min_tokens
        # forbids) in one of n = 2 (seed 0 draws a word of several tokens, and a digit), beside a free
        # request: that request ends with the reason, and its blocks and matchers go; the free one is
        # as it is alone.
        grammar = Grammar.regex("[0-9]|[a-z]{9}", "guided_regex")
        stuck = SamplingParams(temperature=1.5, seed=0, n=2, max_tokens=8, min_tokens=3, grammar=grammar)
        failed, free = llm.generate(["A digit or a word:", prompts[1]], [stuck, plain])
        assert failed.error is not None and "no next token is possible" in failed.error
        assert free.error is None and free.outputs[0].token_ids == alone
        assert not engine.core.structured_output.is_active and not engine.core.has_unfinished
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        drawn = llm.generate("A digit or a word:", dataclasses.replace(stuck, min_tokens=0))
        assert sorted(len(o.text) for o in drawn[0].outputs) == [1, 9]  # the siblings do differ
        # Alone: the word's sibling is ended with the request at the step where the digit's finds no
        # token, not left running to finish its word after the request has failed.
        assert llm.generate("A digit or a word:", stuck)[0].error is not None
        assert not engine.core.has_unfinished
