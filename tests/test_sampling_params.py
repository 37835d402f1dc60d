"""SamplingParams check their own fields once, when built, whatever the transport builds them (HTTP,
gRPC, the offline `LLM`); the model-dependent checks are the input processor's (test_api_* and
test_async_engine). No model, no server."""

from __future__ import annotations

import math

import pytest

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
