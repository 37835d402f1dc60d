"""The sampler's own contract, beside its reference test (tests/test_sampler_reference.py, which holds
the filtered distributions to transformers'): the grammar's bitmask, log-probabilities, seeds,
greedy rows, min_tokens and the occurrence counts behind the penalties. CPU only, no model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.service.engine.core.request import Request
from pagoda.service.engine.core.scheduler import GrammarBitmask
from pagoda.service.engine.messages import NO_TOKEN
from pagoda.service.engine.runner import sampler as sampler_module
from pagoda.service.engine.runner.sampler import (
    BitmaskStaging,
    Sampler,
    _token_counts,
    apply_token_bitmask,
    unpack_forbidden,
)
from pagoda.service.sampling_params import SamplingParams

VOCAB = 100
EOS = 2


def _request(params: SamplingParams, index: int = 0, output: list[int] | None = None) -> Request:
    req = Request(f"r{index}", [5, 6, 7], params, 0.0, index=index)
    req.token_ids += output or []
    return req


def _greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8, **kwargs)  # type: ignore[arg-type]


def _mask(allowed: list[int], words: int = (VOCAB + 31) // 32) -> np.ndarray:
    """One bitmask row allowing exactly `allowed`."""
    row = np.zeros(words, dtype=np.uint32)
    for t in allowed:
        row[t // 32] |= np.uint32(1 << (t % 32))
    return row.view(np.int32)


def test_apply_token_bitmask_keeps_exactly_the_allowed_tokens() -> None:
    vocab, words = 100, 3  # 96 bits: tokens 96..99 lie past the mask and are forbidden
    rng = np.random.default_rng(0)
    bitmask = rng.integers(-(2**31), 2**31, size=(2, words), dtype=np.int32)
    logits = torch.randn(3, vocab)
    masked = apply_token_bitmask(logits.clone(), [0, 2], torch.from_numpy(bitmask))
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").astype(bool)
    for row, mask_row in ((0, 0), (2, 1)):
        allowed = torch.from_numpy(np.concatenate([bits[mask_row], np.zeros(vocab - 96, dtype=bool)]))
        assert torch.equal(masked[row][allowed], logits[row][allowed])
        assert torch.isneginf(masked[row][~allowed]).all()
    assert torch.equal(masked[1], logits[1])  # a row without a grammar is untouched
    # The GPU's unpacking (torch shifts) agrees with the CPU's (numpy), run here on CPU tensors.
    assert torch.equal(unpack_forbidden(torch.from_numpy(bitmask)), torch.from_numpy(~bits))


def test_a_bitmask_wider_than_the_vocabulary_is_cut_to_it() -> None:
    """A padded vocabulary's mask has more bits than the logits have columns (4 words, 100 tokens)."""
    logits = torch.randn(2, VOCAB)
    bitmask = np.stack([_mask([3, 99], words=4), _mask([0, 64], words=4)])
    masked = apply_token_bitmask(logits.clone(), [0, 1], torch.from_numpy(bitmask))  # every row
    assert masked.shape == (2, VOCAB)
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [3, 99]
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [0, 64]


def test_a_grammar_row_samples_only_what_its_mask_allows_and_its_neighbours_are_free() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    logits[:, 50] = 30.0  # everyone's favourite, which the grammar forbids
    reqs = [_request(_greedy(), i) for i in range(3)]
    reqs[2].params = SamplingParams(temperature=1.0, max_tokens=8)
    grammar = GrammarBitmask([1, 2], np.stack([_mask([7, 8]), _mask([9])]))
    got = [r.token_id for r in Sampler(VOCAB, {EOS})(logits.clone(), reqs, grammar).results()]
    assert got[0] == 50
    assert got[1] == (7 if logits[1, 7] > logits[1, 8] else 8)
    assert got[2] == 9  # sampled, but only one token is allowed


def test_allowed_token_ids_keep_a_row_to_them_and_leave_its_neighbours_free() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    logits[:, 50] = 30.0  # everyone's favourite, outside the allowed sets
    reqs = [
        _request(_greedy(allowed_token_ids=[7, 8]), 0),
        _request(_greedy(), 1),
        _request(SamplingParams(temperature=1.0, max_tokens=8, allowed_token_ids=[9, 11]), 2),
    ]
    sampler = Sampler(VOCAB, {EOS})
    for _ in range(20):  # the sampled row draws only its two tokens, and each of them
        got = [r.token_id for r in sampler(logits.clone(), reqs).results()]
        assert got[0] == (7 if logits[0, 7] > logits[0, 8] else 8) and got[1] == 50
        assert got[2] in (9, 11)
    logits[2, 11] = logits[2, 9]  # equal odds: both come up
    drawn = {sampler(logits.clone(), reqs).results()[2].token_id for _ in range(40)}
    assert drawn == {9, 11}
    # The allowed tokens' own logits, not zeros: a logprob is the softmax over the allowed set.
    reqs[0].params.logprobs = 1
    out = sampler(logits.clone(), reqs).results()[0]
    expected = torch.log_softmax(logits[0, [7, 8]], 0).max().item()
    assert out.logprob == pytest.approx(expected, abs=1e-5)


def test_a_row_whose_masks_leave_no_token_reads_no_token_and_its_device_token_stays_real() -> None:
    """allowed_token_ids and a grammar with nothing in common, and a grammar that allows only EOS under
    min_tokens: the host reads NO_TOKEN for those rows (the core fails them), greedy or sampled; the
    device's token, which the next step reads as an input id, stays a vocabulary id; the rows beside
    them sample as ever."""
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    logits[:, 50] = 30.0
    reqs = [
        _request(_greedy(allowed_token_ids=[7, 8]), 0),
        _request(SamplingParams(temperature=1.0, max_tokens=8, allowed_token_ids=[7, 8], logprobs=1), 1),
        _request(_greedy(min_tokens=3), 2),
        _request(_greedy(), 3),
    ]
    grammar = GrammarBitmask([0, 1, 2], np.stack([_mask([9]), _mask([9]), _mask([EOS])]))
    batch = Sampler(VOCAB, {EOS})(logits.clone(), reqs, grammar)
    assert [r.token_id for r in batch.results()] == [NO_TOKEN, NO_TOKEN, NO_TOKEN, 50]
    assert ((batch.tokens >= 0) & (batch.tokens < VOCAB)).all()
    # One token in common (8): sampled there, not marked.
    grammar = GrammarBitmask([0, 1], np.stack([_mask([8, 9]), _mask([8, 9])]))
    assert [r.token_id for r in Sampler(VOCAB, {EOS})(logits[:2].clone(), reqs[:2], grammar).results()] == [
        8,
        8,
    ]


def test_the_allowed_ids_kept_on_the_device_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each request's list is uploaded once and kept between steps, but never more ids than the bound
    altogether: past it the kept lists are dropped, and a running request's is uploaded again."""
    monkeypatch.setattr(sampler_module, "ALLOWED_IDS_HELD", 10)
    sampler = Sampler(VOCAB, {EOS})
    lists = [[7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17]]
    first = sampler._allowed_ids(lists[0], torch.device("cpu"))
    assert sampler._allowed_ids(lists[0], torch.device("cpu")) is first  # kept: not uploaded again
    sampler._allowed_ids(lists[1], torch.device("cpu"))
    assert sampler._allowed_ids_held == 8
    third = sampler._allowed_ids(lists[2], torch.device("cpu"))  # 8 + 3 > 10: the others dropped
    assert sampler._allowed_ids_held == 3 and list(sampler._allowed) == [id(lists[2])]
    assert third.tolist() == lists[2]
    assert sampler._allowed_ids(lists[0], torch.device("cpu")).tolist() == lists[0]  # uploaded again


def test_a_plain_greedy_batch_with_allowed_token_ids_keeps_to_them() -> None:
    """A batch of greedy rows alone takes the raw logits' argmax, unless a row limits its tokens."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 50] = 30.0
    reqs = [_request(_greedy(allowed_token_ids=[61]), 0), _request(_greedy(), 1)]
    assert [r.token_id for r in Sampler(VOCAB, {EOS})(logits, reqs).results()] == [61, 50]


def test_the_grammar_overrides_a_logit_bias() -> None:
    logits = torch.zeros(1, VOCAB)
    req = _request(_greedy(logit_bias={40: 100.0}))
    grammar = GrammarBitmask([0], np.stack([_mask([41])]))
    assert Sampler(VOCAB, {EOS})(logits, [req], grammar).results()[0].token_id == 41


def test_logprobs_per_row_are_the_chosen_token_and_the_top_k_of_the_masked_distribution() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB) * 2
    reqs = [
        _request(_greedy(logprobs=2), 0),
        _request(_greedy(), 1),  # no logprobs asked
        _request(_greedy(logprobs=5), 2),
        _request(_greedy(logprobs=0), 3),  # the chosen token's logprob, no alternatives
    ]
    grammar = GrammarBitmask([2], np.stack([_mask([10, 11, 12])]))
    results = Sampler(VOCAB, {EOS})(logits.clone(), reqs, grammar).results()
    expected = torch.log_softmax(logits, dim=-1)
    masked = torch.full((VOCAB,), float("-inf"))
    masked[[10, 11, 12]] = logits[2, [10, 11, 12]]
    expected[2] = torch.log_softmax(masked, dim=-1)
    assert results[1].logprob is None and results[1].top is None
    for row, k in ((0, 2), (2, 5), (3, 0)):
        result = results[row]
        assert result.token_id == int(expected[row].argmax())
        assert result.logprob == pytest.approx(float(expected[row, result.token_id]), abs=1e-5)
        assert result.top is not None and len(result.top) == k
        top = expected[row].topk(k) if k else None
        if top is not None:
            assert [t for t, _ in result.top] == top.indices.tolist()
            assert [v for _, v in result.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert results[2].top is not None and {t for t, _ in results[2].top[:3]} == {10, 11, 12}
    assert all(v == float("-inf") for _, v in results[2].top[3:])  # forbidden tokens: logprob -inf


def test_the_logprob_of_a_sampled_token_is_its_own() -> None:
    torch.manual_seed(2)
    logits = torch.randn(8, VOCAB)
    reqs = [_request(SamplingParams(temperature=1.0, max_tokens=8, logprobs=1), i) for i in range(8)]
    expected = torch.log_softmax(logits, dim=-1)
    for i, result in enumerate(Sampler(VOCAB, {EOS})(logits.clone(), reqs).results()):
        assert result.logprob == pytest.approx(float(expected[i, result.token_id]), abs=1e-5)


def test_a_seed_draws_the_same_token_alone_or_in_a_batch_and_each_position_its_own() -> None:
    torch.manual_seed(3)
    logits = torch.zeros(1, VOCAB)  # uniform: every draw is up to the seed
    sampler = Sampler(VOCAB, {EOS})

    def draw(seed: int, index: int = 0, output: list[int] | None = None, neighbours: int = 0) -> int:
        params = SamplingParams(temperature=1.0, max_tokens=64, seed=seed)
        free = [_request(SamplingParams(temperature=1.0, max_tokens=8), 9) for _ in range(neighbours)]
        batch = [*free, _request(params, index, output)]
        return sampler(logits.expand(len(batch), VOCAB).clone(), batch).results()[-1].token_id

    assert draw(7) == draw(7) == draw(7, neighbours=3)
    assert len({draw(seed) for seed in range(12)}) > 1
    assert len({draw(7, index=i) for i in range(12)}) > 1  # each of the n completions its own draws
    assert len({draw(7, output=[1] * n) for n in range(12)}) > 1  # and each position


def test_a_mixed_batch_takes_greedy_rows_argmax_and_samples_the_others() -> None:
    torch.manual_seed(6)
    logits = torch.randn(4, VOCAB)
    sampled = [SamplingParams(temperature=1.0, max_tokens=8, seed=s) for s in (11, 12)]
    reqs = [_request(_greedy(), 0), _request(sampled[0], 1), _request(_greedy(), 2), _request(sampled[1], 3)]
    sampler = Sampler(VOCAB, {EOS})
    got = [r.token_id for r in sampler(logits.clone(), reqs).results()]
    alone = [sampler(logits[i : i + 1].clone(), [reqs[i]]).results()[0].token_id for i in (1, 3)]
    assert [got[0], got[2]] == logits[[0, 2]].argmax(dim=-1).tolist()
    assert [got[1], got[3]] == alone


def test_temperature_zero_is_greedy_whatever_the_filters() -> None:
    torch.manual_seed(4)
    logits = torch.randn(16, VOCAB)
    reqs = [_request(_greedy(top_k=50, top_p=0.5, min_p=0.1), i) for i in range(16)]
    got = [r.token_id for r in Sampler(VOCAB, {EOS})(logits.clone(), reqs).results()]
    assert got == logits.argmax(dim=-1).tolist()


def test_min_tokens_bans_stop_token_ids_and_eos_unless_eos_is_ignored() -> None:
    logits = torch.zeros(4, VOCAB)
    logits[:, EOS] = 20.0
    logits[:, 30] = 10.0
    logits[:, 31] = 5.0
    reqs = [
        _request(_greedy(min_tokens=4), 0),  # EOS banned: 30
        _request(_greedy(min_tokens=4, stop_token_ids=[30]), 1),  # EOS and 30 banned: 31
        _request(_greedy(min_tokens=4, ignore_eos=True, stop_token_ids=[30, VOCAB + 5]), 2),  # EOS free
        _request(_greedy(min_tokens=2), 3, output=[9, 9]),  # reached: EOS allowed again
    ]
    got = [r.token_id for r in Sampler(VOCAB, {EOS, 3})(logits.clone(), reqs).results()]
    assert got == [30, 31, EOS, EOS]


def test_min_tokens_bans_every_eos_of_the_model() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, [EOS, 3]] = 20.0
    got = Sampler(VOCAB, {EOS, 3})(logits, [_request(_greedy(min_tokens=1))]).results()
    assert got[0].token_id not in (EOS, 3)


def test_token_counts_count_each_row_apart_and_ignore_the_padding() -> None:
    counts = _token_counts([[1, 1, 4], [], [VOCAB - 1]], VOCAB, torch.device("cpu"))
    assert counts.shape == (3, VOCAB)
    assert counts[0, 1] == 2 and counts[0, 4] == 1 and counts[0].sum() == 3
    assert counts[1].sum() == 0
    assert counts[2, VOCAB - 1] == 1 and counts[2].sum() == 1
    assert _token_counts([[], []], VOCAB, torch.device("cpu")).sum() == 0


def test_logits_wider_than_the_vocabulary_never_yield_a_padding_token() -> None:
    logits = torch.zeros(2, VOCAB + 28)
    logits[:, VOCAB + 3] = 50.0  # a padded column of the embedding
    reqs = [_request(_greedy(logprobs=1), 0), _request(SamplingParams(temperature=1.0, max_tokens=8), 1)]
    assert all(r.token_id < VOCAB for r in Sampler(VOCAB, {EOS})(logits, reqs).results())


def test_min_p_of_one_keeps_only_the_most_likely_token() -> None:
    """The floor is min_p times the top probability: at 1 only the top token reaches it."""
    torch.manual_seed(5)
    logits = torch.randn(32, VOCAB)
    params = SamplingParams(temperature=1.0, max_tokens=8, min_p=1.0)
    got = [
        r.token_id
        for r in Sampler(VOCAB, {EOS})(logits.clone(), [_request(params, i) for i in range(32)]).results()
    ]
    assert got == logits.argmax(dim=-1).tolist()


def test_logit_bias_is_added_to_the_logit_not_put_in_its_place() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 10] = 10.0
    logits[0, 11] = 10.5
    nudged = _request(_greedy(logit_bias={10: 1.0}))  # 11 beats 10.5: token 10
    assert Sampler(VOCAB, {EOS})(logits.clone(), [nudged]).results()[0].token_id == 10
    small = _request(_greedy(logit_bias={12: 1.0}))  # 1 (0 + 1) is far below 10.5: token 11
    assert Sampler(VOCAB, {EOS})(logits.clone(), [small]).results()[0].token_id == 11


def test_a_stop_token_id_just_past_the_vocabulary_is_ignored_by_min_tokens() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 30] = 5.0
    req = _request(_greedy(min_tokens=2, stop_token_ids=[VOCAB, 30]))
    assert Sampler(VOCAB, {EOS})(logits, [req]).results()[0].token_id != 30


def test_token_counts_with_an_odd_vocabulary() -> None:
    """The padding goes to a spare column one past the vocabulary, whatever its parity."""
    counts = _token_counts([[0, 0], [98]], 99, torch.device("cpu"))
    assert counts.shape == (2, 99) and counts[0, 0] == 2 and counts[1, 98] == 1 and counts.sum() == 3


def test_top_p_keeps_the_smallest_set_that_reaches_it_exactly() -> None:
    """Two tokens of 0.5 each (exact in float32) and top_p 0.5: the first alone reaches it, so the second
    is dropped: every row samples the same token (a strict `>` at the boundary kept both)."""
    logits = torch.full((64, VOCAB), float("-inf"))
    logits[:, [11, 42]] = 0.0
    params = SamplingParams(temperature=1.0, max_tokens=8, top_p=0.5)
    reqs = [_request(params, i) for i in range(64)]
    got = {r.token_id for r in Sampler(VOCAB, {EOS})(logits, reqs).results()}
    assert len(got) == 1 and got <= {11, 42}
    both = SamplingParams(temperature=1.0, max_tokens=8, top_p=0.75)  # one more token is needed: both stay
    got = {
        r.token_id for r in Sampler(VOCAB, {EOS})(logits, [_request(both, i) for i in range(64)]).results()
    }
    assert got == {11, 42}


def _unpinned(shape: tuple[int, int]) -> torch.Tensor:
    """Test double for the page-locked allocation, which needs a GPU: plain host memory, same shape."""
    return torch.empty(shape, dtype=torch.int32)


def test_the_bitmask_staging_buffer_holds_the_mask_and_is_reused_until_it_no_longer_fits() -> None:
    staging = BitmaskStaging(_unpinned)
    rng = np.random.default_rng(4)
    masks = {
        rows: rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int32)
        for rows, words in ((1, 4), (64, 4), (3, 4), (65, 4), (2, 5))
    }
    first = staging.stage(masks[1])
    assert np.array_equal(first.numpy(), masks[1])
    buffer = first.data_ptr()
    # Room for 64 rows from the first step; a smaller batch after a larger one reuses it too.
    for rows in (64, 3):
        staged = staging.stage(masks[rows])
        assert staged.data_ptr() == buffer and np.array_equal(staged.numpy(), masks[rows])
    grown = staging.stage(masks[65])  # past its room: a new, larger buffer
    assert grown.data_ptr() != buffer and np.array_equal(grown.numpy(), masks[65])
    assert staging.stage(masks[3][:, :4]).data_ptr() == grown.data_ptr()
    other_width = staging.stage(masks[2])  # another vocabulary width: a buffer of that many words
    assert other_width.shape == (2, 5) and np.array_equal(other_width.numpy(), masks[2])
    assert other_width.data_ptr() != grown.data_ptr()
    narrower = staging.stage(masks[64][:2, :3].copy())
    assert narrower.shape == (2, 3) and np.array_equal(narrower.numpy(), masks[64][:2, :3])


def test_a_staged_mask_masks_as_the_mask_itself_does() -> None:
    logits = torch.randn(3, VOCAB)
    bitmask = np.stack([_mask([1, 2, 3]), _mask([60, 61])])
    staged = BitmaskStaging(_unpinned).stage(bitmask)
    assert torch.equal(
        apply_token_bitmask(logits.clone(), [0, 2], staged),
        apply_token_bitmask(logits.clone(), [0, 2], torch.from_numpy(bitmask)),
    )


def test_a_logit_bias_of_minus_100_bans_the_token_outright() -> None:
    logits = torch.zeros(2, VOCAB)
    reqs = [_request(_greedy(logit_bias={4: -100, 5: -99.5})), _request(_greedy(logit_bias={4: -100.0}), 1)]
    adjusted = Sampler(VOCAB, {EOS}).adjusted_logits(logits, reqs)
    assert torch.isneginf(adjusted[:, 4]).all()
    assert adjusted[0, 5] == -99.5  # only the floor itself is a ban


def test_top_p_of_one_keeps_the_whole_tail_beside_a_row_that_filters() -> None:
    """A float32 softmax can put the mass before a tail token at 1.0 exactly (rounding): top_p 1 must
    still keep it, even when another row's top_p makes the batch sort and filter."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 0] = 30.0  # p(0) rounds to 1.0; every other token ~1e-13
    reqs = [_request(SamplingParams(temperature=1.0, top_p=1.0), 0), _request(SamplingParams(top_p=0.5), 1)]
    probs = Sampler(VOCAB, {EOS}).filtered_probs(logits, reqs)
    assert (probs[0] > 0).all()
    assert (probs[1] > 0).nonzero().flatten().tolist() == [0]


def test_a_repetition_penalty_of_two_halves_positive_and_doubles_negative_logits_of_seen_tokens() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 3.0  # in the prompt (5, 6, 7)
    logits[:, 6] = -3.0
    logits[:, 9] = 3.0  # never seen
    reqs = [_request(_greedy(repetition_penalty=2.0), i) for i in range(2)]
    adjusted = Sampler(VOCAB, {EOS}).adjusted_logits(logits, reqs)
    assert adjusted[:, 5].tolist() == [1.5, 1.5] and adjusted[:, 6].tolist() == [-6.0, -6.0]
    assert adjusted[:, 9].tolist() == [3.0, 3.0]


def test_plain_greedy_rows_in_the_model_dtype_pick_what_float32_picks() -> None:
    """A step graph hands the sampler bf16 logits; a batch of plain greedy rows takes their argmax as
    they are. Ties (bf16 rounds many logits together) and a padded column must come out as through
    float32, and a row that needs more than the argmax (here its log-probabilities) widens the batch."""
    torch.manual_seed(0)
    logits = (torch.randn(6, VOCAB + 28) * 3).to(torch.bfloat16)
    logits[:, VOCAB + 5] = 100.0  # a padded column of the embedding
    logits[1, 17] = logits[1, 40] = logits[1, :VOCAB].max() + 1  # a tie: the first wins
    logits[2, :VOCAB] = 0.0  # all tied
    want = logits[:, :VOCAB].float().argmax(dim=1).tolist()
    assert want[1:3] == [17, 0]
    plain = [_request(_greedy(), i) for i in range(6)]
    assert [r.token_id for r in Sampler(VOCAB, {EOS})(logits, plain).results()] == want
    with_logprobs = [*plain[:5], _request(_greedy(logprobs=2), 5)]
    results = Sampler(VOCAB, {EOS})(logits, with_logprobs).results()
    assert [r.token_id for r in results] == want
    assert results[5].logprob == pytest.approx(
        torch.log_softmax(logits[5, :VOCAB].float(), 0)[want[5]].item()
    )


@pytest.mark.parametrize(
    ("params", "output", "raw", "want"),
    [
        (_greedy(presence_penalty=1.0), [5], {5: 1.0, 9: 0.5}, 9),
        (_greedy(frequency_penalty=1.0), [5], {5: 1.0, 9: 0.5}, 9),
        (_greedy(repetition_penalty=2.0), [], {5: 1.0, 9: 0.75}, 9),  # 5 is in the prompt: 1.0 -> 0.5
        (_greedy(repetition_penalty=0.5), [], {5: 1.0, 9: 1.5}, 5),  # below 1 it raises seen tokens: 2.0
        (_greedy(logit_bias={9: 5.0}), [], {5: 1.0}, 9),
        (_greedy(min_tokens=3), [], {EOS: 1.0, 9: 0.5}, 9),  # EOS banned before 3 tokens
        (_greedy(logprobs=1), [], {5: 1.0}, 5),
        (_greedy(allowed_token_ids=[9, 11]), [], {5: 1.0, 9: 0.5}, 9),
    ],
    ids=[
        "presence",
        "frequency",
        "repetition 2",
        "repetition 0.5",
        "logit_bias",
        "min_tokens",
        "logprobs",
        "allowed_token_ids",
    ],
)
def test_a_greedy_batch_that_asks_for_more_than_the_raw_argmax_gets_it(
    params: SamplingParams, output: list[int], raw: dict[int, float], want: int
) -> None:
    """The greedy shortcut (the argmax of the logits as given) must not take a batch whose every row
    moves a logit or asks for log-probabilities: each such batch alone, where the raw argmax differs
    from the answer (or the log-probabilities would be missing)."""
    logits = torch.zeros(2, VOCAB)
    for token, value in raw.items():
        logits[:, token] = value
    reqs = [_request(params, i, list(output)) for i in range(2)]
    results = Sampler(VOCAB, {EOS})(logits, reqs).results()
    assert [r.token_id for r in results] == [want, want]
    if params.logprobs is not None:
        expected = torch.log_softmax(logits[0], 0)[want].item()
        assert all(r.logprob == pytest.approx(expected) and r.top is not None for r in results)


def test_a_plain_greedy_batch_under_a_grammar_keeps_to_it() -> None:
    """Plain greedy rows, but one under a grammar that forbids the argmax: not the shortcut's batch."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 50] = 30.0
    reqs = [_request(_greedy(), i) for i in range(2)]
    grammar = GrammarBitmask([1], np.stack([_mask([7])]))
    assert [r.token_id for r in Sampler(VOCAB, {EOS})(logits, reqs, grammar).results()] == [50, 7]
