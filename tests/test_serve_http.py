"""The OpenAI-compatible HTTP API of a real `pagoda serve` process, through the official `openai` client.

The model is a tiny random-weight Llama: its text is garbage, so the tests compare the server with
itself (streamed vs not, stop strings cut where the unstopped text had them) and count tokens with
`ignore_eos` (a vLLM extension, sent as `extra_body`).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.service.serve_process import ServeProcess

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
EXACT = {"ignore_eos": True}  # count tokens exactly: never stop early on a random EOS


# What a thinking model's template does with vLLM's chat_template_kwargs (Qwen3's `enable_thinking`).
NO_THINKING = (
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
)


@pytest.fixture(scope="module")
def server(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """The tiny Llama, its chat template ending as a thinking model's does (NO_THINKING)."""
    ckpt = tmp_path_factory.mktemp("thinking") / "ckpt"
    shutil.copytree(llama_ckpt, ckpt)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config["chat_template"] += NO_THINKING
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    args = ["--model", str(ckpt), "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN)]
    args += ["--kv-cache-memory-bytes", str(32 << 20), "--max-num-seqs", "64"]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with ServeProcess(args, log_path=log) as proc:
        yield proc
    assert proc.proc is not None and proc.proc.returncode == 0, proc.log()[-3000:]


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client: openai.OpenAI, **kwargs: object) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)  # type: ignore[call-overload]


def test_health_and_models(server: ServeProcess, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.base_url}/v1/health/live").status_code == 200
    assert httpx.get(f"{server.base_url}/v1/health/ready").json() == {"status": "ready"}
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_streamed_equals_not_streamed(client: openai.OpenAI) -> None:
    full = chat(client, max_tokens=12, temperature=0, extra_body=EXACT)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert full.usage is not None and full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 10
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12

    chunks = list(
        chat(
            client,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXACT,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, 12)
    # The same prompt again: its full blocks come from the prefix cache.
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_streamed_equals_not_streamed(client: openai.OpenAI) -> None:
    full = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, extra_body=EXACT
    )
    assert full.choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 10
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True, extra_body=EXACT
    )
    assert "".join(c.choices[0].text for c in stream) == full.choices[0].text


def test_completions_prompt_forms_and_echo(client: openai.OpenAI) -> None:
    tokens = [1, 520, 1741, 282, 3065]
    by_ids = client.completions.create(
        model=MODEL, prompt=tokens, max_tokens=4, temperature=0, extra_body=EXACT
    )
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(tokens)

    batch = client.completions.create(
        model=MODEL, prompt=["Hello", "The sky is"], max_tokens=4, temperature=0, n=2, extra_body=EXACT
    )
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.usage is not None and batch.usage.completion_tokens == 16

    echoed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert echoed.choices[0].text == "Hello" + plain.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI, llama_ckpt: Path) -> None:
    """What evaluation harnesses send to score a text: echo + logprobs; checked against transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    tokens = [1, 520, 1741, 282, 3065, 77, 9000]
    reply = client.completions.create(
        model=MODEL, prompt=tokens, max_tokens=1, temperature=0, echo=True, logprobs=2
    )
    scored = reply.choices[0].logprobs
    assert scored is not None and scored.token_logprobs is not None and scored.top_logprobs is not None
    assert len(scored.token_logprobs) == len(tokens) + 1
    assert scored.token_logprobs[0] is None and scored.top_logprobs[0] is None
    model = AutoModelForCausalLM.from_pretrained(llama_ckpt, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([tokens])).logits[0, :-1], -1)
    expected = expected.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()
    assert scored.token_logprobs[1 : len(tokens)] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) == 2 for top in scored.top_logprobs[1:])

    streamed = client.completions.create(
        model=MODEL, prompt=tokens, max_tokens=1, temperature=0, echo=True, logprobs=2, stream=True
    )
    first = next(iter(streamed)).choices[0].logprobs
    assert first is not None and first.token_logprobs is not None
    assert first.token_logprobs[1 : len(tokens)] == pytest.approx(expected, abs=1e-4)
    # The generated token's offset counts the echoed prompt once, as the answer not streamed does.
    assert first.text_offset == scored.text_offset


def test_prompt_logprobs_in_vllms_shape(
    server: ServeProcess, client: openai.OpenAI, llama_ckpt: Path
) -> None:
    """vLLM's `prompt_logprobs`: on a completion's choice and on a chat response, per prompt position
    (None first) the prompt's token with its logprob and rank, then the position's top k at ranks
    1..k; checked against transformers. Beside echo + logprobs each keeps its own k; streamed, and on
    the Responses API, it is a 400 naming the field."""
    import torch
    from transformers import AutoModelForCausalLM

    tokens = [1, 520, 1741, 282, 3065, 77, 9000]
    model = AutoModelForCausalLM.from_pretrained(llama_ckpt, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([tokens])).logits[0, :-1], -1)
    reply = client.completions.create(
        model=MODEL, prompt=tokens, max_tokens=1, echo=True, logprobs=1, extra_body={"prompt_logprobs": 3}
    )
    positions = reply.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(positions) == len(tokens) and positions[0] is None
    for j, entry in enumerate(positions[1:]):
        row, token = expected[j], tokens[j + 1]
        top = row.topk(3)
        assert next(iter(entry)) == str(token)  # the prompt's token first, then the top k
        assert entry[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        likelier = (row > row[token] + 1e-4).sum().item(), (row > row[token] - 1e-4).sum().item() - 1
        assert likelier[0] + 1 <= entry[str(token)]["rank"] <= likelier[1] + 1  # -1: not itself
        for rank, (value, t) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
            if t != token:
                assert entry[str(t)]["rank"] == rank and entry[str(t)]["logprob"] == pytest.approx(
                    value, abs=1e-4
                )
        assert len(entry) == 3 + (token not in top.indices.tolist())
        assert all(isinstance(e["decoded_token"], str) for e in entry.values())
    echoed = reply.choices[0].logprobs
    assert echoed is not None and echoed.top_logprobs is not None
    assert all(len(top) == 1 for top in echoed.top_logprobs[1 : len(tokens)])  # echo's own k, not 3

    answer = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    positions = answer.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert positions[0] is None and all(len(entry) == 1 for entry in positions[1:])
    assert answer.usage is not None and len(positions) == answer.usage.prompt_tokens
    assert "prompt_logprobs" not in chat(client, max_tokens=1).model_extra  # type: ignore[operator]
    for route, body in (
        ("/v1/completions", {"prompt": "hi", "stream": True}),
        ("/v1/chat/completions", {"messages": MESSAGES, "stream": True}),
        ("/v1/responses", {"input": "hi"}),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}),  # vLLM's "whole vocabulary": no
        ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 10**6}),
    ):
        refused = httpx.post(f"{server.base_url}{route}", json={"model": MODEL, "prompt_logprobs": 1, **body})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs", (
            refused.text
        )


def test_n2_and_seed_reproducibility(client: openai.OpenAI) -> None:
    kwargs = dict(max_tokens=8, temperature=1.0, n=2, seed=1234, extra_body=EXACT)
    first, again = chat(client, **kwargs), chat(client, **kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert first.usage is not None and first.usage.completion_tokens == 16
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]


def test_stop_string_cuts_where_the_text_had_it(client: openai.OpenAI) -> None:
    prompt = "The quick brown fox"
    free = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body=EXACT
    )
    text = free.choices[0].text
    candidates = [
        text[i : i + 3] for i in range(3, len(text) - 3) if text[i : i + 3].strip() == text[i : i + 3]
    ]
    assert candidates, f"no stop candidate in {text!r}"
    stop = candidates[0]
    for stream, included in ((False, False), (True, False), (False, True), (True, True)):
        result = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop], stream=stream,
            extra_body={"include_stop_str_in_output": included},
        )  # fmt: skip
        if stream:
            chunks = list(result)  # type: ignore[arg-type]
            got, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            got, reason = result.choices[0].text, result.choices[0].finish_reason  # type: ignore[union-attr]
        # vLLM's include_stop_str_in_output: the text ends after the stop string instead of before it.
        end = text.index(stop) + (len(stop) if included else 0)
        assert (got, reason) == (text[:end], "stop")


def test_logprobs(client: openai.OpenAI) -> None:
    result = chat(client, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, extra_body=EXACT)
    content = result.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)

    completion = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=2, extra_body=EXACT
    )
    lp = completion.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == 5 and len(lp.token_logprobs) == 5
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == completion.choices[0].text
    assert lp.text_offset[0] == 0


def test_n2_streamed_with_stop_and_logprobs_equals_not_streamed(client: openai.OpenAI) -> None:
    """Streamed chunks carry only what each step added (the final output alone holds the whole text):
    per choice, they add up to the answer not streamed, text, logprobs and usage alike."""
    kwargs: dict[str, object] = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, n=2)
    kwargs |= dict(temperature=1.0, seed=99, logprobs=2, extra_body=EXACT)
    text = client.completions.create(**kwargs).choices[0].text  # type: ignore[call-overload]
    stop = next(text[i : i + 3] for i in range(4, len(text) - 3) if text[i : i + 3].strip())
    full = client.completions.create(stop=[stop], **kwargs)  # type: ignore[call-overload]
    chunks = list(
        client.completions.create(  # type: ignore[call-overload]
            stop=[stop], stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    assert full.choices[0].text == text[: text.index(stop)] and full.choices[0].finish_reason == "stop"
    assert len(chunks) > 2 * 4  # streamed, not one blob per choice
    for choice in full.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        streamed = [c.logprobs for c in mine if c.logprobs is not None]
        assert [t for lp in streamed for t in lp.tokens or []] == choice.logprobs.tokens
        assert [o for lp in streamed for o in lp.text_offset or []] == choice.logprobs.text_offset
        scores = [x for lp in streamed for x in lp.token_logprobs or []]
        assert scores == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)
    usage = chunks[-1].usage
    assert usage is not None and full.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,
    )
    assert full.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in full.choices)


def test_64_concurrent_streams_complete_with_correct_usage(server: ServeProcess) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str | None]:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Request number {i}"}],
            max_tokens=8 + i % 5,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXACT,
        )
        usage, finish = None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        assert usage is not None
        return i, usage.completion_tokens, finish

    async def main() -> list[tuple[int, int, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert [(i, n, f) for i, n, f in results] == [(i, 8 + i % 5, "length") for i in range(64)]


def _error(response: httpx.Response) -> dict[str, object]:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "in_message"),
    [
        ("/v1/chat/completions", {"model": "nope", "messages": MESSAGES}, 404, "model", "nope"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "temperature": -1},
            400,
            "temperature",
            "temperature",
        ),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": "many"}, 400, "max_tokens", "integer"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least one"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "robot", "content": "x"}]},
            400,
            "messages.0.role",
            "",
        ),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 0}, 400, "top_p", "top_p"),
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 0}, 400, "n", "n must be"),
        ("/v1/completions", {"prompt": [5] * (MAX_MODEL_LEN + 10)}, 400, "prompt", f"{MAX_MODEL_LEN} tokens"),
        (
            "/v1/completions",
            {"prompt": "hi", "max_tokens": MAX_MODEL_LEN * 2},
            400,
            "max_tokens",
            "context length",
        ),
        ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
        ("/v1/completions", {"prompt": [10**9]}, 400, "prompt", "out of range"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs", "logprobs"),
        (
            "/v1/completions",
            {"prompt": "hi", "allowed_token_ids": []},
            400,
            "allowed_token_ids",
            "at least one",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "allowed_token_ids": [3, 10**9]},
            400,
            "allowed_token_ids",
            "range",
        ),
        ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [-1]}, 400, "allowed_token_ids", "range"),
        (
            "/v1/completions",
            {"prompt": "hi", "truncate_prompt_tokens": -3},
            400,
            "truncate_prompt_tokens",
            "-1",
        ),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "chat_template_kwargs": {"tools": "x"}},
            400,
            "chat_template_kwargs",
            "may not set tools",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "truncate_prompt_tokens": MAX_MODEL_LEN + 1},
            400,
            "truncate_prompt_tokens",
            f"context length ({MAX_MODEL_LEN})",
        ),
        # vLLM extensions Pagoda does not implement: refused by name, never ignored.
        (
            "/v1/completions",
            {"prompt": "hi", "use_beam_search": True},
            400,
            "use_beam_search",
            "not supported",
        ),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "bad_words": ["x"]},
            400,
            "bad_words",
            "not supported",
        ),
        ("/v1/completions", {"prompt": "hi", "length_penalty": 0.5}, 400, "length_penalty", "not supported"),
        (
            "/v1/completions",
            {"prompt": "hi", "return_tokens_as_token_ids": True},
            400,
            "return_tokens_as_token_ids",
            "not supported",
        ),
    ],
)
def test_bad_input_gets_status_and_error_shape(
    server: ServeProcess, path: str, body: dict[str, object], status: int, param: str, in_message: str
) -> None:
    response = httpx.post(server.base_url + path, json=body, timeout=30)
    assert response.status_code == status, response.text
    error = _error(response)
    assert error["param"] == param and in_message in str(error["message"])
    # ... and the server keeps serving.
    ok = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_allowed_token_ids_and_truncate_prompt_tokens(server: ServeProcess, client: openai.OpenAI) -> None:
    """vLLM's two extensions, through the openai client's extra_body: a sampled answer keeps to the
    allowed tokens; a prompt longer than the context runs on its last k tokens."""
    allowed = [300, 301, 302, 303]
    result = client.completions.create(
        model=MODEL, prompt=[7, 8, 9], max_tokens=8, temperature=1.5, seed=3, logprobs=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )  # fmt: skip
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and len(logprobs.tokens) == 8
    texts = {
        t: httpx.post(f"{server.base_url}/detokenize", json={"model": MODEL, "tokens": [t]}).json()["prompt"]
        for t in allowed
    }
    assert set(logprobs.tokens) <= set(texts.values()), (logprobs.tokens, texts)
    long = client.completions.create(
        model=MODEL, prompt=[5] * (MAX_MODEL_LEN + 40), max_tokens=2, extra_body={"truncate_prompt_tokens": 9}
    )
    assert long.usage is not None and long.usage.prompt_tokens == 9
    # Echoed, the prompt is what the model saw: its last 9 tokens.
    prompt = list(range(300, 300 + MAX_MODEL_LEN + 40))
    echoed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, echo=True, extra_body={"truncate_prompt_tokens": 9}
    )
    seen = httpx.post(f"{server.base_url}/detokenize", json={"model": MODEL, "tokens": prompt[-9:]}).json()
    assert echoed.choices[0].text.startswith(seen["prompt"]) and len(echoed.choices[0].text) < 4 * len(
        seen["prompt"]
    )


def test_openai_client_sees_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)  # type: ignore[arg-type]
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        chat(client, temperature=5.0, top_p=-1)


def test_malformed_json_unknown_route_and_ignored_params(server: ServeProcess) -> None:
    bad = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert bad.status_code == 400 and _error(bad)["type"] == "invalid_request_error"
    missing = httpx.get(f"{server.base_url}/v1/nothing-here")
    assert missing.status_code == 404 and _error(missing)
    extra = {
        "logit_bias": {"5": 1},
        "response_format": {"type": "text"},
        "parallel_tool_calls": False,
        "foo": 1,
    }
    ok = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 2, "user": "u1", **extra},
        timeout=30,
    )
    assert ok.status_code == 200, ok.text


def _metric(server: ServeProcess, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _wait_until_aborted_and_freed(server: ServeProcess, aborted: str, before: float) -> None:
    """The abort counter is the API process's; the running and KV gauges are the engine core's as of its
    next message after the abort: wait for both (20 s at most), then require the abort."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        gauges = ("pagoda_kv_cache_usage_ratio", "pagoda_requests_running")
        freed = all(_metric(server, name) == 0 for name in gauges)
        if _metric(server, aborted) > before and freed:
            break
        time.sleep(0.05)
    assert _metric(server, aborted) == before + 1


def test_client_disconnect_aborts_the_request(server: ServeProcess) -> None:
    aborted = 'pagoda_requests_finished_total{finish_reason="abort"}'
    before_abort = _metric(server, aborted)
    before_tokens = _metric(server, "pagoda_generation_tokens_total")
    body = {"prompt": "Tell a long story", "max_tokens": MAX_MODEL_LEN - 20, "stream": True, **EXACT}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"]
    # The connection is closed here, long before 236 tokens are generated.
    _wait_until_aborted_and_freed(server, aborted, before_abort)
    assert _metric(server, "pagoda_requests_running") == 0
    assert _metric(server, "pagoda_kv_cache_usage_ratio") == 0
    assert _metric(server, "pagoda_generation_tokens_total") - before_tokens < MAX_MODEL_LEN - 20


def test_client_gone_before_a_non_streamed_answer_aborts_it(server: ServeProcess) -> None:
    aborted = 'pagoda_requests_finished_total{finish_reason="abort"}'
    before_abort = _metric(server, aborted)
    before_tokens = _metric(server, "pagoda_generation_tokens_total")
    body = {"prompt": "Tell a long story", "max_tokens": MAX_MODEL_LEN - 20, **EXACT}
    with pytest.raises(httpx.TimeoutException):  # the client gives up after 50 ms
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.05))
    _wait_until_aborted_and_freed(server, aborted, before_abort)
    assert _metric(server, "pagoda_kv_cache_usage_ratio") == 0
    assert _metric(server, "pagoda_generation_tokens_total") - before_tokens < MAX_MODEL_LEN - 20


def _documented_metrics() -> tuple[list[str], list[str]]:
    """(always exported, GPU only) metric names from docs/metrics.md's tables."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    always, gpu_only = [], []
    section = ""
    for line in doc.splitlines():
        if line.startswith("## "):
            section = line
        elif any(w in section for w in ("operator", "router", "Speculative", "LoRA")):  # not this server's
            continue
        elif match := re.match(r"\| `([a-z0-9_:]+)` \|", line):
            (gpu_only if "GPU" in section else always).append(match.group(1))
    return always, gpu_only


def _exported_names(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def test_metrics_exports_every_documented_name_and_values_move(server: ServeProcess) -> None:
    always, gpu_only = _documented_metrics()
    assert len(always) >= 20 and len(gpu_only) == 3
    before = httpx.get(f"{server.base_url}/metrics")
    assert before.headers["content-type"].startswith("text/plain")
    exported = _exported_names(before.text)
    # prometheus_client types counters by their name without `_total`, and info metrics without `_info`.
    missing = [
        n
        for n in always
        if n not in exported and n.removesuffix("_total").removesuffix("_info") not in exported
    ]
    assert not missing, f"documented but not exported: {missing}"
    has_gpu = any(n in exported for n in gpu_only)
    assert has_gpu == all(n in exported for n in gpu_only)

    names = [
        "pagoda_prompt_tokens_total",
        "pagoda_generation_tokens_total",
        "pagoda_time_to_first_token_seconds_count",
        "pagoda_inter_token_latency_seconds_count",
        "pagoda_e2e_request_latency_seconds_count",
        "pagoda_request_queue_time_seconds_count",
        'pagoda_requests_finished_total{finish_reason="length"}',
        'pagoda_request_errors_total{error="not_found"}',
        "pagoda_prefix_cache_queries_total",
        'pagoda_output_delay_seconds_count{stage="core_to_api"}',
        'pagoda_output_delay_seconds_count{stage="api_process"}',
        'pagoda_output_delay_seconds_count{stage="stream_wait"}',
        'pagoda_engine_step_duration_seconds_count{kind="decode"}',
        'pagoda_engine_step_duration_seconds_count{kind="mixed"}',
    ]
    start = {n: _metric(server, n) for n in names}
    body = {"prompt": "Metrics move", "max_tokens": 5, **EXACT}
    assert httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30).status_code == 200
    assert httpx.post(f"{server.base_url}/v1/completions", json={**body, "model": "x"}).status_code == 404
    end = {n: _metric(server, n) for n in names}
    assert [n for n in names if end[n] <= start[n]] == []
    assert end["pagoda_generation_tokens_total"] - start["pagoda_generation_tokens_total"] == 5
    steps = {k: end[n] - start[n] for k, n in (("decode", names[-2]), ("mixed", names[-1]))}
    assert steps == {"decode": 4, "mixed": 1}  # the prompt's step made the first token, then 4 decodes
    assert (
        end["pagoda_inter_token_latency_seconds_count"] - start["pagoda_inter_token_latency_seconds_count"]
        == 4
    )

    text = httpx.get(f"{server.base_url}/metrics").text
    assert f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0.0' in text
    assert re.search(r'vllm:cache_config_info\{block_size="16",num_gpu_blocks="\d+"\} 1.0', text)


def _samples(server: ServeProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape by (name, its labels sorted)."""
    text = httpx.get(f"{server.base_url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_http_series_count_each_route_by_status_class_and_leave_the_probes_out(server: ServeProcess) -> None:
    """vLLM's per-route series (prometheus-fastapi-instrumentator): one count per request by route,
    method and status class, a path no route matches as `none`, sizes from Content-Length; the probes,
    the router's load polls and the scrapes themselves are not counted."""
    before = _samples(server)
    url = f"{server.base_url}/v1/completions"
    body = {"model": MODEL, "prompt": "Count me", "max_tokens": 2, **EXACT}
    ok = httpx.post(url, json=body, timeout=30)
    missing = httpx.post(url, json={**body, "model": "x"}, timeout=30)
    nowhere = httpx.get(f"{server.base_url}/v1/no/such/route")
    assert (ok.status_code, missing.status_code, nowhere.status_code) == (200, 404, 404)
    uncounted = ["/health", "/v1/health/live", "/v1/health/ready", "/get_load", "/version", "/metrics"]
    for path in uncounted:
        assert httpx.get(f"{server.base_url}{path}").status_code == 200, path
    after = _samples(server)

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    completions = {"handler": "/v1/completions"}
    assert moved("http_requests_total", method="POST", status="2xx", **completions) == 1
    assert moved("http_requests_total", method="POST", status="4xx", **completions) == 1
    assert moved("http_requests_total", method="GET", status="4xx", handler="none") == 1
    assert moved("http_request_duration_seconds_count", method="POST", **completions) == 2
    assert moved("http_request_duration_highr_seconds_count") == 3
    sent = len(ok.request.content) + len(missing.request.content)
    assert moved("http_request_size_bytes_sum", **completions) == sent
    assert moved("http_response_size_bytes_sum", **completions) == len(ok.content) + len(missing.content)
    handlers = {dict(labels).get("handler") for name, labels in after if name.startswith("http_")}
    assert handlers.isdisjoint(uncounted), handlers


def test_hostile_sampling_values_are_refused_or_harmless(server: ServeProcess, client: openai.OpenAI) -> None:
    """Two of these used to kill the engine for every client (a huge top_k overflowed in the sampler; a
    negative stop token id indexed out of bounds): now one is harmless and the others are 400s."""
    ok = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=3, extra_body={"top_k": 10**19, "ignore_eos": True}
    )
    assert len(ok.choices[0].text) > 0 and ok.choices[0].finish_reason == "length"
    refused = [
        {"min_tokens": 2, "stop_token_ids": [-100000]},
        {"stop_token_ids": [10**12]},
        {"n": 129},
    ]
    for extra in refused:
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, extra_body=extra)
        assert next(iter(extra.keys() - {"min_tokens"})) in str(error.value)
    assert server.ready_status() == 200


def test_render_endpoints_give_the_token_ids_generation_runs_on(
    server: ServeProcess, client: openai.OpenAI
) -> None:
    """vLLM's `/v1/completions/render` and `/v1/chat/completions/render` (what routers key prefix
    affinity on): a string prompt as `/tokenize` encodes it, token ids as sent, one entry per prompt,
    and a chat's ids exactly as many as the completion's prompt tokens."""
    url = server.base_url
    tokenized = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "Once upon a time"}).json()
    one = httpx.post(f"{url}/v1/completions/render", json={"model": MODEL, "prompt": "Once upon a time"})
    assert one.status_code == 200 and one.json() == [{"token_ids": tokenized["tokens"]}]

    def render(prompt: object) -> object:
        return httpx.post(f"{url}/v1/completions/render", json={"model": MODEL, "prompt": prompt}).json()

    assert render(["Once upon a time", "x"])[0] == {"token_ids": tokenized["tokens"]}  # type: ignore[index]
    assert render([[7, 8, 9], [4]]) == [{"token_ids": [7, 8, 9]}, {"token_ids": [4]}]
    assert render([7, 8, 9]) == [{"token_ids": [7, 8, 9]}]
    chat = httpx.post(f"{url}/v1/chat/completions/render", json={"model": MODEL, "messages": MESSAGES})
    assert chat.status_code == 200
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)  # type: ignore[arg-type]
    assert answer.usage is not None and len(chat.json()["token_ids"]) == answer.usage.prompt_tokens


def test_chat_template_kwargs_reach_the_template(server: ServeProcess, client: openai.OpenAI) -> None:
    """vLLM's chat_template_kwargs: a thinking model's `enable_thinking: false` renders its empty
    thought, in the render endpoint and in the chat the server runs; what the request gives the template
    itself (messages, tools, add_generation_prompt, special tokens) it may not replace."""
    url = f"{server.base_url}/v1/chat/completions/render"

    def rendered(**extra: object) -> list[int]:
        response = httpx.post(url, json={"model": MODEL, "messages": MESSAGES, **extra})
        assert response.status_code == 200, response.text
        return response.json()["token_ids"]  # type: ignore[no-any-return]

    plain, no_thinking = rendered(), rendered(chat_template_kwargs={"enable_thinking": False})
    assert no_thinking[: len(plain)] == plain and len(no_thinking) > len(plain)
    assert rendered(chat_template_kwargs={"enable_thinking": True}) == plain
    answer = chat(client, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert answer.usage is not None and answer.usage.prompt_tokens == len(no_thinking)
    for kwargs in ({"messages": []}, {"add_generation_prompt": False}, {"bos_token": "x"}):
        refused = httpx.post(url, json={"model": MODEL, "messages": MESSAGES, "chat_template_kwargs": kwargs})
        assert refused.status_code == 400 and _error(refused)["param"] == "chat_template_kwargs", refused.text
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        chat(client, max_tokens=1, extra_body={"continue_final_message": True})


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/v1/completions/render", {"model": MODEL, "prompt": ""}, 400, "prompt must not be empty"),
        ("/v1/completions/render", {"model": MODEL, "prompt": [[], [1]]}, 400, "prompt must not be empty"),
        ("/v1/completions/render", {"model": "no-such-model", "prompt": "x"}, 404, "no-such-model"),
        ("/v1/completions/render", {"model": MODEL, "prompt": [1, "x"]}, 400, "prompt"),
        ("/v1/completions/render", {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt"),
        ("/v1/chat/completions/render", {"model": MODEL, "messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions/render", {"model": MODEL, "messages": [{"role": "wizard"}]}, 400, "role"),
        (
            "/v1/chat/completions/render",
            {"model": "no-such-model", "messages": MESSAGES},
            404,
            "no-such-model",
        ),
    ],
)
def test_render_refuses_bad_input_with_its_reason(
    server: ServeProcess, path: str, body: dict[str, object], status: int, says: str
) -> None:
    response = httpx.post(f"{server.base_url}{path}", json=body)
    assert response.status_code == status, response.text
    assert says in response.json()["error"]["message"], response.text
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # and the server is none the worse
