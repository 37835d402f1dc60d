"""SamplingParams check their own fields once, when built, whatever the transport builds them (HTTP,
gRPC, the offline `LLM`); the model-dependent checks are the input processor's (test_api_* and
test_async_engine). No model, no server."""

from __future__ import annotations

import math

import pytest

from pagoda.service.engine.client.input_processor import InputProcessor
from pagoda.service.errors import InvalidRequestError
from pagoda.service.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, SEED_RANGE, SamplingParams

REFUSED = [
    ("n", {"n": 0}),
    ("temperature", {"temperature": -0.01}),
    ("temperature", {"temperature": math.nan}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.01}),
    ("top_k", {"top_k": -2}),
    ("min_p", {"min_p": -0.1}),
    ("min_p", {"min_p": 1.1}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -2.5}),
    ("frequency_penalty", {"frequency_penalty": math.inf}),
    ("seed", {"seed": SEED_RANGE[1] + 1}),
    ("seed", {"seed": SEED_RANGE[0] - 1}),
    ("max_tokens", {"max_tokens": 0}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ("logprobs", {"logprobs": MAX_LOGPROBS + 1}),
    ("prompt_logprobs", {"prompt_logprobs": -1}),
    ("stop", {"stop": ["x"] * (MAX_STOP_STRINGS + 1)}),
    ("stop", {"stop": [""]}),
    ("allowed_token_ids", {"allowed_token_ids": []}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": 0}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": -2}),
]


@pytest.mark.parametrize(("param", "fields"), REFUSED, ids=[f"{p}={v}" for p, v in REFUSED])
def test_a_bad_field_is_refused_when_built_and_named(param: str, fields: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(**fields)  # type: ignore[arg-type]
    assert refused.value.param == param


def test_the_edges_of_every_range_are_accepted() -> None:
    params = SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        seed=SEED_RANGE[1],
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        max_tokens=3,
        min_tokens=3,
        logprobs=MAX_LOGPROBS,
        stop="end",
    )
    assert params.top_k == 0 and params.stop == ["end"] and params.is_greedy
    assert SamplingParams(seed=SEED_RANGE[0], max_tokens=None, min_tokens=10**6).seed == SEED_RANGE[0]
    assert SamplingParams(allowed_token_ids=[0], truncate_prompt_tokens=1).truncate_prompt_tokens == 1
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt_tokens == -1


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens() -> None:
    """vLLM's semantics: the last k tokens; -1 the context length; more than the context refused. Token-id
    prompts only here (no tokenizer is needed for them)."""
    processor = InputProcessor(None, vocab_size=100, max_model_len=16)  # type: ignore[arg-type]
    prompt = list(range(40, 70))  # 30 tokens: more than the context holds
    assert processor.process(prompt, SamplingParams(truncate_prompt_tokens=5, max_tokens=1)) == prompt[-5:]
    assert processor.process(prompt[:3], SamplingParams(truncate_prompt_tokens=5, max_tokens=1)) == prompt[:3]
    with pytest.raises(InvalidRequestError, match="context length") as full:
        processor.process(prompt, SamplingParams(truncate_prompt_tokens=-1, max_tokens=1))  # 16 kept: no room
    assert full.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as too_many:
        processor.process(prompt, SamplingParams(truncate_prompt_tokens=17, max_tokens=1))
    assert too_many.value.param == "truncate_prompt_tokens"
    with pytest.raises(InvalidRequestError) as untruncated:
        processor.process(prompt, SamplingParams(max_tokens=1))
    assert untruncated.value.param == "prompt"


def test_allowed_token_ids_are_checked_against_the_vocabulary_and_kept_once_each() -> None:
    processor = InputProcessor(None, vocab_size=10, max_model_len=16)  # type: ignore[arg-type]
    params = SamplingParams(allowed_token_ids=[5, 3, 5, 9], max_tokens=1)
    processor.process([1, 2], params)
    assert params.allowed_token_ids == [3, 5, 9]
    every = SamplingParams(allowed_token_ids=[*range(10), 4], max_tokens=1)
    processor.process([1, 2], every)
    assert every.allowed_token_ids is None  # every token allowed: no mask to apply

    class EosOnly:  # a stand-in tokenizer: only its end-of-sequence ids are read
        eos_token_ids = frozenset({2})

    processor.tokenizer = EosOnly()  # type: ignore[assignment]
    for stops in ({"allowed_token_ids": [2]}, {"allowed_token_ids": [2, 7], "stop_token_ids": [7]}):
        with pytest.raises(InvalidRequestError, match="min_tokens") as nothing_left:
            processor.process([1, 2], SamplingParams(min_tokens=2, max_tokens=4, **stops))  # type: ignore[arg-type]
        assert nothing_left.value.param == "allowed_token_ids"
    for fine in ({"min_tokens": 0}, {"min_tokens": 2, "ignore_eos": True}):
        processor.process([1, 2], SamplingParams(allowed_token_ids=[2], max_tokens=4, **fine))  # type: ignore[arg-type]
    for bad in ([10], [-1]):
        with pytest.raises(InvalidRequestError, match=r"out of range \[0, 10\)") as refused:
            processor.process([1, 2], SamplingParams(allowed_token_ids=bad, max_tokens=1))
        assert refused.value.param == "allowed_token_ids"
