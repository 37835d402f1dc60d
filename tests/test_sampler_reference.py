"""The batched sampler against an independent reference: Hugging Face transformers' logits processors
(temperature, top-k, top-p, min-p, repetition penalty) and OpenAI's documented formula for presence
and frequency penalties, applied one row at a time, on the same logits. Every row of the batch has
its own settings, as a real batch does. Then the draws themselves: sampled tokens follow the
filtered distribution. On a machine with a CUDA GPU every test runs there as well (the GPU machine:
`python -m pytest tests/test_sampler_reference.py`)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pagoda.service.engine.core.request import Request
from pagoda.service.engine.runner.sampler import Sampler
from pagoda.service.sampling_params import SamplingParams

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
VOCAB = 64
EOS = 2
PROMPT = [5, 9, 9, 17, 30]
OUTPUT = [9, 41, 41, 41, 7]  # repeats, so frequency differs from presence

SETTINGS: list[dict[str, float | int]] = [
    {},  # plain temperature 1
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 5},
    {"top_p": 0.8},
    {"temperature": 0.9, "min_p": 0.1},
    {"top_k": 10, "top_p": 0.9, "min_p": 0.05},
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.8, "temperature": 0.5},
    {"presence_penalty": 0.5, "frequency_penalty": 0.3},
    {"presence_penalty": -1.0, "frequency_penalty": 1.5, "top_p": 0.95},
    {"presence_penalty": 1.0},  # each alone: the penalties are applied when either is set
    {"frequency_penalty": 0.7},
    {"temperature": 2.0, "top_k": 1},
]


def _request(params: SamplingParams, index: int = 0) -> Request:
    req = Request(f"r{index}", PROMPT, params, 0.0, index=index)
    req.token_ids += OUTPUT
    return req


def _reference(logits: torch.Tensor, settings: dict[str, float | int]) -> torch.Tensor:
    """One row through transformers' processors in generate()'s order, then softmax."""
    scores = logits[None].clone()
    input_ids = torch.tensor([PROMPT + OUTPUT])
    counts = torch.bincount(torch.tensor(OUTPUT), minlength=VOCAB).float()
    # OpenAI: mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty, over generated tokens.
    scores -= counts * float(settings.get("frequency_penalty", 0.0))
    scores -= (counts > 0).float() * float(settings.get("presence_penalty", 0.0))
    if "repetition_penalty" in settings:
        scores = RepetitionPenaltyLogitsProcessor(float(settings["repetition_penalty"]))(input_ids, scores)
    scores = TemperatureLogitsWarper(float(settings.get("temperature", 1.0)))(input_ids, scores)
    if "top_k" in settings:
        scores = TopKLogitsWarper(int(settings["top_k"]))(input_ids, scores)
    if "top_p" in settings:
        scores = TopPLogitsWarper(float(settings["top_p"]))(input_ids, scores)
    if "min_p" in settings:
        scores = MinPLogitsWarper(float(settings["min_p"]))(input_ids, scores)
    return scores.softmax(dim=-1)[0]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _ours(logits: torch.Tensor, reqs: list[Request], device: str = "cpu") -> torch.Tensor:
    """Our filtered distribution, computed on `device`, returned on the CPU."""
    sampler = Sampler(VOCAB, {EOS})
    logits = logits.to(device)
    probs = sampler.filtered_probs(sampler.adjusted_logits(logits, reqs), reqs)
    return (probs / probs.sum(dim=-1, keepdim=True)).cpu()


def test_each_row_of_a_mixed_batch_matches_transformers_processors(device: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(len(SETTINGS), VOCAB) * 3
    reqs = [_request(SamplingParams(max_tokens=8, **s), i) for i, s in enumerate(SETTINGS)]  # type: ignore[arg-type]
    ours = _ours(logits, reqs, device)
    for i, settings in enumerate(SETTINGS):
        expected = _reference(logits[i], settings)
        assert torch.equal(ours[i] > 0, expected > 0), f"row {i} {settings}: a different set of tokens kept"
        # Relative: a penalty on a token of tiny probability (1e-7) must show too.
        torch.testing.assert_close(ours[i], expected, atol=1e-12, rtol=1e-4, msg=f"row {i} {settings}")


def test_a_row_does_not_depend_on_its_neighbours(device: str) -> None:
    """The same request alone and in the mixed batch: the same distribution."""
    torch.manual_seed(1)
    logits = torch.randn(len(SETTINGS), VOCAB) * 3
    reqs = [_request(SamplingParams(max_tokens=8, **s), i) for i, s in enumerate(SETTINGS)]  # type: ignore[arg-type]
    batch = _ours(logits, reqs, device)
    for i in range(len(SETTINGS)):
        torch.testing.assert_close(batch[i], _ours(logits[i : i + 1], reqs[i : i + 1], device)[0])


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.6, "top_k": 8}, {"top_p": 0.7, "min_p": 0.02}])
def test_draws_follow_the_filtered_distribution(settings: dict[str, float], device: str) -> None:
    """20,000 rows drawn at once: the empirical distribution is within sampling noise of the filtered
    one (total variation under 0.03; its expected size here is about 0.02 at most), and no token
    outside it is ever drawn."""
    torch.manual_seed(2)
    rows = 20_000
    logits = (torch.randn(VOCAB) * 2).expand(rows, VOCAB).contiguous().to(device)
    params = SamplingParams(max_tokens=8, **settings)  # type: ignore[arg-type]
    reqs = [_request(params, 0)] * rows
    sampler = Sampler(VOCAB, {EOS})
    tokens = sampler(logits, reqs).results()
    drawn = torch.bincount(torch.tensor([t.token_id for t in tokens]), minlength=VOCAB).float() / rows
    expected = _ours(logits[:1], reqs[:1], device)[0]
    assert drawn[expected == 0].sum() == 0
    assert 0.5 * (drawn - expected).abs().sum() < 0.03


def test_seeded_draws_follow_the_filtered_distribution(device: str) -> None:
    """20,000 rows of distinct seeds (one each, the noise `seeded_noise` hashes): the same bound as
    unseeded draws, and the same tokens again for the same seeds."""
    torch.manual_seed(5)
    rows = 20_000
    logits = (torch.randn(VOCAB) * 2).expand(rows, VOCAB).contiguous().to(device)
    settings = {"temperature": 0.8, "top_p": 0.9}
    reqs = [_request(SamplingParams(max_tokens=8, seed=seed, **settings), 0) for seed in range(rows)]  # type: ignore[arg-type]
    sampler = Sampler(VOCAB, {EOS})
    tokens = [t.token_id for t in sampler(logits, reqs).results()]
    drawn = torch.bincount(torch.tensor(tokens), minlength=VOCAB).float() / rows
    expected = _ours(logits[:1], reqs[:1], device)[0]
    assert drawn[expected == 0].sum() == 0
    assert 0.5 * (drawn - expected).abs().sum() < 0.03
    assert [t.token_id for t in sampler(logits, reqs).results()] == tokens


def test_greedy_rows_logit_bias_and_min_tokens_in_one_batch(device: str) -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, VOCAB, device=device)
    logits[:, EOS] = 50.0  # EOS is everyone's favourite
    reqs = [
        _request(SamplingParams(temperature=0.0, max_tokens=8), 0),  # greedy: EOS
        _request(SamplingParams(temperature=0.0, max_tokens=8, logit_bias={EOS: -100}), 1),  # banned
        _request(SamplingParams(temperature=0.0, max_tokens=32, min_tokens=20), 2),  # too early for EOS
        _request(SamplingParams(temperature=0.0, max_tokens=8, logit_bias={33: 100}), 3),
    ]
    got = [r.token_id for r in Sampler(VOCAB, {EOS})(logits, reqs).results()]
    second_best = int(logits[1].topk(2).indices[1])
    assert got == [EOS, second_best, int(logits[2].topk(2).indices[1]), 33]
