"""Speculative decoding by prompt lookup: the drafts, the load rule, the verifier's distribution, and
the engine's output against the same engine without speculation (greedy: token for token)."""

from __future__ import annotations

import contextlib
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagoda.service.engine.config import EngineConfig, SpeculativeConfig
from pagoda.service.engine.core.block_manager import BlockManager
from pagoda.service.engine.core.request import PLACEHOLDER, Request
from pagoda.service.engine.core.scheduler import GrammarBitmask, Scheduler
from pagoda.service.engine.core.speculation import drafts_per_sequence, propose_ngram
from pagoda.service.engine.messages import NO_TOKEN
from pagoda.service.engine.runner.sampler import Sampler
from pagoda.service.engine.runner.spec_verify import verify_drafts
from pagoda.service.llm import LLM
from pagoda.service.sampling_params import SamplingParams

# The tests that count kept drafts draft whatever the step rates say (`adaptive` decides by wall time:
# StepRates has tests of its own, and one engine test runs with it on).
NGRAM = {
    "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
    "adaptive": False,
}  # fmt: skip


# ---- the drafts ---------------------------------------------------------------------------------


def test_prompt_lookup_follows_the_most_recent_longest_match() -> None:
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # "2 3" recurs at 1 and 6; the most recent match (6) is followed by 7 8 5.
    assert propose_ngram(tokens, 3, 4, 2) == [7, 8, 5]
    assert propose_ngram(tokens, 2, 4, 2) == [7, 8]
    # A longer suffix wins over a more recent shorter one: "1 2 3" at 0 and 5, then "2 3" alone at 11.
    tokens = [1, 2, 3, 4, 6, 0, 2, 3, 5, 1, 2, 3]
    assert propose_ngram(tokens, 2, 3, 2) == [4, 6]
    assert propose_ngram(tokens, 2, 2, 2) == [5, 1]  # lookup_max 2: only "2 3", whose last match is at 6


def test_prompt_lookup_without_a_match_or_near_the_end() -> None:
    assert propose_ngram([1, 2, 3, 4, 5], 3, 4, 2) == []
    assert propose_ngram([4, 5, 4], 3, 4, 2) == []  # "5 4" never occurred before; "4" alone is too short
    assert propose_ngram([4, 5, 4], 3, 4, 1) == [5, 4]  # "4" at 0, followed by what is left
    # A run of one token: the most recent match overlaps the suffix (one token after it); the earliest
    # has the most after it.
    assert propose_ngram([7, 7, 7, 7, 7], 3, 2, 2) == [7, 7, 7]
    assert propose_ngram([7, 7, 7, 7], 3, 2, 2) == [7, 7]
    # The longest suffix first, though a shorter one would leave more to draft ("7 7 7 7" only at 0).
    assert propose_ngram([7, 7, 7, 7, 7], 3, 4, 2) == [7]
    assert propose_ngram([1, 2, 5, 1, 2, 6, 8, 1, 2], 2, 2, 2) == [6, 8]  # the most recent with two after
    assert propose_ngram([3], 2, 4, 1) == []
    assert propose_ngram([4, 4], 2, 4, 1) == [4]  # shorter than lookup_max: n starts at length - 1
    assert propose_ngram([1, 2, 9, 1, 2], 2, 4, 3) == []  # "1 2" recurs, but lookup_min is 3
    assert propose_ngram([7, 6, 8, 5, 6], 2, 2, 2) == []  # "7 6" ends like "5 6": the first token counts too
    # The most recent match with exactly k tokens after it (it ends where the suffix starts) is taken.
    assert propose_ngram([1, 2, 9, 9, 9, 1, 2, 7, 1, 2], 3, 2, 2) == [7, 1, 2]


def test_the_load_rule_drafts_less_as_the_batch_grows_and_none_past_half_the_cap() -> None:
    config = SpeculativeConfig(num_speculative_tokens=4, max_batch_tokens=64)
    assert [drafts_per_sequence(config, b) for b in (0, 1, 12, 13, 16, 22, 32, 33, 200)] == [
        0, 4, 4, 3, 3, 1, 1, 0, 0,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be a positive"),
        ('{"method": "eagle"}', "method must be ngram or draft_model"),
        ('{"method": "draft_model", "num_speculative_tokens": 4}', 'a draft model is {"model": PATH'),
        ('{"method": "ngram", "model": "/models/draft"}', 'a draft model is {"model": PATH'),
        ('{"method": "ngram", "lookahead": 3}', "unknown field(s) ['lookahead']"),
        ('{"prompt_lookup_max": 1, "prompt_lookup_min": 2}', "prompt_lookup_max must be an integer from"),
        ('{"prompt_lookup_max": 100000}', "from prompt_lookup_min (2) to 64, got 100000"),
        ('{"num_speculative_tokens": true}', "num_speculative_tokens must be a positive"),
        ('{"num_speculative_tokens": 17}', "at most 16"),
        ("[3]", "takes a JSON object"),
    ],
)
def test_a_bad_speculative_config_is_refused_with_its_reason(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="--speculative-config") as refused:
        SpeculativeConfig.from_json(text)
    assert says in str(refused.value)


def test_the_flag_parses_into_the_engine_config() -> None:
    from pagoda.cli import build_parser
    from pagoda.service import cli as serve_cli

    parser = build_parser()
    args = parser.parse_args(["serve", "--speculative-config", json.dumps(NGRAM)])
    _, config = serve_cli.build_configs(args)
    assert config.speculative == SpeculativeConfig(**NGRAM)  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--speculative-config", '{"method": "medusa"}'])


# ---- the verifier -------------------------------------------------------------------------------


def _drafting(params: SamplingParams, drafts: list[int], index: int = 0) -> Request:
    req = Request(f"r{index}", [1, 2, 3], params, 0.0, index=index)
    req.add_drafts(drafts)
    return req


def test_greedy_verification_keeps_drafts_while_they_are_the_argmax() -> None:
    sampler = Sampler(8, eos_token_ids=set())
    logits = torch.full((4, 8), -5.0)
    for row, top in enumerate([4, 6, 2, 7]):  # argmax of each row: 4, 6, 2, 7
        logits[row, top] = 5.0
    greedy = SamplingParams(temperature=0.0)
    assert verify_drafts(sampler, logits, [_drafting(greedy, [4, 6, 2])]) == [(7, 3)]  # all kept: the bonus
    assert verify_drafts(sampler, logits, [_drafting(greedy, [4, 5, 2])]) == [(6, 1)]  # the 2nd is wrong
    assert verify_drafts(sampler, logits, [_drafting(greedy, [0, 6, 2])]) == [(4, 0)]
    assert verify_drafts(sampler, logits, [_drafting(greedy, [4, 7, 2])]) == [(6, 1)]  # above the argmax
    # Two requests' rows side by side: 2 + 2 rows.
    both = verify_drafts(sampler, logits, [_drafting(greedy, [4], 0), _drafting(greedy, [1], 1)])
    assert both == [(6, 1), (2, 0)]  # rows 2-3 (argmax 2, 7) judge the second: 1 is not 2


def test_verification_keeps_to_allowed_token_ids() -> None:
    """A draft outside the request's allowed tokens is rejected even where it is the argmax, and the
    token after the kept drafts is the best allowed one."""
    sampler = Sampler(8, eos_token_ids=set())
    logits = torch.full((3, 8), -5.0)
    for row, top in enumerate([4, 6, 2]):
        logits[row, top] = 5.0
    logits[:, 3] = 1.0  # the best allowed token everywhere but where an allowed token leads
    allowed = SamplingParams(temperature=0.0, allowed_token_ids=[3, 4])
    assert verify_drafts(sampler, logits, [_drafting(allowed, [4, 6])]) == [(3, 1)]  # 6: not allowed
    sampled = SamplingParams(temperature=1.0, seed=5, allowed_token_ids=[3, 4])
    for _ in range(5):
        token, kept = verify_drafts(sampler, logits, [_drafting(sampled, [4, 6])])[0]
        assert kept <= 1 and token in (3, 4)


def test_verification_marks_a_position_where_no_token_is_possible() -> None:
    """A draft row whose allowed tokens the grammar forbids: the verdict's token is NO_TOKEN (the core
    fails the request), not a token outside both."""
    sampler = Sampler(8, eos_token_ids=set())
    logits = torch.zeros(2, 8)
    allowed = SamplingParams(temperature=0.0, allowed_token_ids=[3, 4])
    grammar = GrammarBitmask([0, 1], np.array([[1 << 3 | 1 << 5], [1 << 5]], dtype=np.int32))
    assert verify_drafts(sampler, logits, [_drafting(allowed, [3])], grammar) == [(NO_TOKEN, 1)]
    assert verify_drafts(sampler, logits, [_drafting(allowed, [4])], grammar) == [(3, 0)]


def test_greedy_verification_sees_min_tokens_at_each_rows_position() -> None:
    """Row j is the sampler's row at output position (before + j): min_tokens bans EOS (token 7) on
    the rows still short of it, and not on the later ones."""
    sampler = Sampler(8, eos_token_ids={7})
    logits = torch.zeros(3, 8)
    logits[:, 7] = 9.0  # EOS is every row's favourite
    logits[:, 3] = 1.0
    params = SamplingParams(temperature=0.0, min_tokens=5)
    req = Request("r", [1, 2, 3], params, 0.0)
    req.token_ids += [3, 3, 3]  # three output tokens before the drafts: rows at output positions 3, 4, 5
    req.add_drafts([3, 3])
    assert verify_drafts(sampler, logits, [req]) == [(7, 2)]  # rows 0 and 1 may not end; row 2 may


def _first_tokens(verdicts: list[tuple[int, int]], drafts: list[list[int]]) -> list[int]:
    return [d[0] if kept else token for (token, kept), d in zip(verdicts, drafts, strict=True)]


@pytest.mark.parametrize(
    ("params", "draft"),
    [
        (SamplingParams(temperature=1.0), 1),  # a likely draft
        (SamplingParams(temperature=1.0), 2),  # an unlikely one (p0 = 0.16)
        (SamplingParams(temperature=1.0), 0),  # token 0 is a token
        (SamplingParams(temperature=1.0, min_p=0.5), 4),  # min-p leaves p unnormalised: the verifier's job
        (SamplingParams(temperature=0.7, top_k=3), 5),  # a draft top-k removes: never kept
        # Seeded: every request's own key (its index differs), its uniform and noise hashed from it.
        (SamplingParams(temperature=1.0, seed=3), 2),
    ],
    ids=["likely", "unlikely", "token-0", "min-p", "filtered", "seeded"],
)
def test_sampled_verification_keeps_the_target_distribution(params: SamplingParams, draft: int) -> None:
    """Leviathan et al.'s guarantee, counted: over 6,000 requests each drafting two tokens, the first
    emitted token is distributed as p0, the token after a kept first draft as p1, and the bonus token
    after both kept as p2 (nothing is judged there: no token may be left out of it)."""
    torch.manual_seed(11)
    vocab, n = 6, 6000
    sampler = Sampler(vocab, eos_token_ids=set())
    p0_logits = torch.tensor([0.0, 1.5, 0.5, -1.0, 1.0, -2.0])
    p1_logits = torch.tensor([1.0, -1.0, 0.0, 2.0, -0.5, 0.5])
    p2_logits = torch.tensor([0.0, 2.0, 0.5, 0.0, -1.0, 0.0])  # the bonus row: token 1 likely
    logits = torch.stack([p0_logits, p1_logits, p2_logits] * n)  # 3 rows per request (2 drafts)
    drafts = [[draft, 3] for _ in range(n)]
    reqs = [_drafting(params, d, i) for i, d in enumerate(drafts)]
    verdicts = verify_drafts(sampler, logits, reqs)

    def target(row_logits: torch.Tensor) -> torch.Tensor:
        probs = sampler.filtered_probs(row_logits.view(1, -1), reqs[:1])[0]
        return probs / probs.sum()

    first = torch.bincount(torch.tensor(_first_tokens(verdicts, drafts)), minlength=vocab) / n
    assert torch.allclose(first, target(p0_logits), atol=0.02), (first, target(p0_logits))
    # After a kept first draft, row 1 judges draft 3 and the emitted token follows p1.
    pairs = zip(verdicts, drafts, strict=True)
    after = [d[1] if kept == 2 else token for (token, kept), d in pairs if kept >= 1]
    if target(p0_logits)[draft] > 0:
        assert len(after) > 500
        second = torch.bincount(torch.tensor(after), minlength=vocab) / len(after)
        tolerance = 2 / len(after) ** 0.5  # four standard deviations of the widest binomial
        assert torch.allclose(second, target(p1_logits), atol=tolerance), (second, target(p1_logits))
        bonus = [token for token, kept in verdicts if kept == 2]
        assert len(bonus) > 200
        third = torch.bincount(torch.tensor(bonus), minlength=vocab) / len(bonus)
        tolerance = 2 / len(bonus) ** 0.5
        assert torch.allclose(third, target(p2_logits), atol=tolerance), (third, target(p2_logits))
    else:
        assert not after  # a filtered draft is never kept


def test_a_seeded_request_verifies_the_same_whatever_its_neighbours() -> None:
    sampler = Sampler(6, eos_token_ids=set())
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(5))
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [verify_drafts(sampler, logits, [_drafting(seeded, [2, 4])])[0] for _ in range(20)]
    other = torch.randn(2, 6)
    neighbour = SamplingParams(temperature=1.0)
    beside = [
        verify_drafts(
            sampler, torch.cat([other, logits]), [_drafting(neighbour, [1], 1), _drafting(seeded, [2, 4])]
        )[1]
        for _ in range(20)
    ]
    assert len(set(alone)) == 1 and set(beside) == set(alone)
    unseeded = {verify_drafts(sampler, logits, [_drafting(SamplingParams(temperature=1.0), [2, 4])])[0]
                for _ in range(40)}  # fmt: skip
    assert len(unseeded) > 1  # the seed is what holds it still


# ---- the scheduler ------------------------------------------------------------------------------


def _running(scheduler: Scheduler, prompt: list[int]) -> Request:
    req = Request(f"s{len(scheduler.running)}", prompt, SamplingParams(max_tokens=50), 0.0)
    scheduler.add(req)
    out = scheduler.schedule()
    assert out.requests == [req]
    scheduler.advance(out)
    req.token_ids[-1] = 9  # the sampled token
    return req


def test_drafts_are_dropped_when_the_step_has_no_room_for_them() -> None:
    scheduler = Scheduler(BlockManager(64, 4, True), max_num_seqs=8, max_num_batched_tokens=3)
    req = _running(scheduler, [1, 2])
    req.add_drafts([5, 6, 7])  # 1 + 3 rows, but the step takes 3 tokens
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == [1] and req.num_drafts == 0 and req.token_ids == [1, 2, 9]
    scheduler.advance(out)
    assert req.num_computed_tokens == 3


def test_drafts_give_way_before_anyone_is_preempted() -> None:
    scheduler = Scheduler(BlockManager(2, 4, False), max_num_seqs=8, max_num_batched_tokens=64)
    first, second = (Request(f"s{i}", [1, 2, 3], SamplingParams(), 0.0) for i in range(2))
    scheduler.add(first)
    scheduler.add(second)
    scheduler.advance(scheduler.schedule())  # a block each, both full with their sampled token
    for req in (first, second):
        req.token_ids[-1] = 9
    second.add_drafts([7, 8])  # positions 4 and 5 would need a third block
    out = scheduler.schedule()
    assert scheduler.num_preemptions == 0 and out.num_scheduled_tokens == [1, 1]
    assert second.num_drafts == 0 and second.token_ids == [1, 2, 3, 9]


def test_blocks_are_hashed_only_over_tokens_the_verifier_kept() -> None:
    """A drafting sequence's full blocks enter the prefix cache only once its drafts are judged."""
    bm = BlockManager(64, 4, True)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    req = _running(scheduler, [1, 2, 3])  # tokens 1 2 3 9: one full block, computed 3
    req.add_drafts([10, 11, 12, 13])
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == [5]
    scheduler.advance(out)
    assert len(bm._hash_to_block) == 0  # the computed drafts fill block 2 (9 10 11 12) but are not judged
    req.drop_drafts(keep=1)  # 10 stays
    assert req.token_ids == [1, 2, 3, 9, 10] and req.num_computed_tokens == 5


def test_advance_goes_on_past_a_drafting_sequence() -> None:
    """A drafting sequence's blocks wait for the verifier, and the batch's others advance as usual:
    their counts, cached blocks and placeholder token."""
    bm = BlockManager(64, 4, True)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    drafting = _running(scheduler, [1, 2, 3])
    drafting.add_drafts([10, 11])
    plain = Request("plain", [20, 21, 22, 23, 24], SamplingParams(), 0.0)
    scheduler.add(plain)
    out = scheduler.schedule()
    assert out.requests == [drafting, plain] and out.num_scheduled_tokens == [3, 5]
    assert scheduler.advance(out) == [drafting, plain]
    assert drafting.num_computed_tokens == 6 and drafting.token_ids == [1, 2, 3, 9, 10, 11]
    assert plain.num_computed_tokens == 5 and plain.token_ids[-1] == PLACEHOLDER
    assert len(bm._hash_to_block) == 1  # plain's full block (20 21 22 23); none of the drafting one's


# ---- the engine ---------------------------------------------------------------------------------


def _repetitive_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] * 3 for n in (4, 7, 11)]


def _spec_stats(llm: LLM) -> Any:
    return llm.engine.core.stats()


@pytest.mark.parametrize("is_async", [False, True], ids=["in-turn", "async"])
def test_greedy_output_is_token_for_token_the_same_with_drafts(llama_ckpt: Path, is_async: bool) -> None:
    """The same prompts, greedy, with and without prompt lookup, in one batch that mixes drafting
    requests with one that asks for log-probabilities (it never drafts), a small step budget (drafts
    dropped, chunked prefill) and the prefix cache: then once more from prompts that extend the first
    outputs, whose cached blocks must hold only kept tokens."""
    common: dict[str, Any] = {
        "dtype": "float32", "kv_cache_memory_bytes": 8 << 20, "max_num_batched_tokens": 24,
        "async_scheduling": is_async,
    }  # fmt: skip
    plain = LLM(str(llama_ckpt), **common)
    spec = LLM(str(llama_ckpt), speculative_config=NGRAM, **common)
    prompts = [[5, 6, 7, 8] * 5, *_repetitive_prompts(1)]  # the first's output repeats one token at length
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 3
    params.append(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2))
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    got = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == expected
    assert [len(o.outputs[0].logprobs or []) for o in got][-1] == 40
    stats = _spec_stats(spec)
    assert stats.spec_num_accepted_tokens_total > 10, stats  # the drafts did something
    assert stats.spec_accepted_per_position_total[2] > 0  # whole drafts too
    assert stats.spec_num_draft_tokens_total > stats.spec_num_accepted_tokens_total
    assert sum(stats.spec_accepted_per_position_total) == stats.spec_num_accepted_tokens_total
    assert stats.spec_accepted_per_position_total == sorted(
        stats.spec_accepted_per_position_total, reverse=True
    )

    longer = [p + e[:30] for p, e in zip(prompts, expected, strict=True)]
    short = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    again = [o.outputs[0].token_ids for o in spec.generate(longer, short)]
    assert again == [o.outputs[0].token_ids for o in plain.generate(longer, short)]
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.prefix_hits_tokens > 0  # the second round read blocks the first one cached


def test_sampled_output_with_a_seed_is_reproducible_and_ends_at_max_tokens(llama_ckpt: Path) -> None:
    spec = LLM(str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20, speculative_config=NGRAM)
    prompts = [*_repetitive_prompts(2)[:2], [5, 6, 7, 8] * 5]  # the last one's output loops, so it drafts
    # A seed whose draws repeat enough for prompt lookup to draft (seed 7 drafted 4 tokens, none kept).
    params = SamplingParams(temperature=0.1, top_k=3, seed=2, max_tokens=33, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    alone = spec.generate(prompts[2], params)[0].outputs[0].token_ids
    assert first[2] == alone
    assert [len(t) for t in first] == [33, 33, 33]  # drafts never run past max_tokens
    stats = _spec_stats(spec)
    assert stats.spec_num_accepted_tokens_total > 5, stats


def test_spec_decode_metrics_under_vllms_names() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from pagoda.service.engine.messages import EngineStats
    from pagoda.service.metrics import _EngineCollector

    stats = EngineStats(
        spec_num_drafts_total=5, spec_num_draft_tokens_total=15, spec_num_accepted_tokens_total=7,
        spec_accepted_per_position_total=[4, 2, 1],
    )  # fmt: skip
    registry = CollectorRegistry()
    registry.register(_EngineCollector(lambda: stats, lambda: "m"))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    for line in [
        'vllm:spec_decode_num_drafts_total{model_name="m"} 5.0',
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 15.0',
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0',
    ]:
        assert line in text, text
    off = CollectorRegistry()
    off.register(_EngineCollector(lambda: EngineStats(), lambda: "m"))  # type: ignore[arg-type]
    assert "spec_decode" not in generate_latest(off).decode()


def test_engine_config_takes_the_speculative_config() -> None:
    config = EngineConfig(speculative=SpeculativeConfig.from_json(json.dumps(NGRAM)))
    assert config.speculative is not None and config.speculative.num_speculative_tokens == 3
    draft = SpeculativeConfig.from_json('{"model": "/models/draft", "num_speculative_tokens": 4}')
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/models/draft", 4)


def test_lookups_that_miss_pause_longer_each_time_and_a_kept_draft_ends_the_pause() -> None:
    from pagoda.service.engine.core.speculation import MAX_PAUSE, Speculator

    speculator = Speculator(SpeculativeConfig(), max_model_len=1000)
    req = Request("p", [1, 2, 3, 4, 5], SamplingParams(), 0.0)  # nothing recurs
    pauses = []
    for token in range(10, 16):
        req.token_ids.append(token)
        speculator.after_token(req, num_running=1)
        req.num_computed_tokens = req.num_tokens - 1  # decoding
        assert req.draft_proposal == [] and not speculator.plan([req])
        pauses.append(req.draft_pause)
        for _ in range(req.draft_pause):  # the paused tokens: no lookup, and the pause runs out
            speculator.after_token(req, num_running=1)
    assert pauses == [2, 4, 8, 8, 8, 8] and MAX_PAUSE == 8
    assert speculator.lookups == 6
    req.token_ids += [10, 11]  # "10 11" recurs: a draft
    speculator.after_token(req, num_running=1)
    req.num_computed_tokens = req.num_tokens - 1  # decoding
    assert req.draft_proposal == [12, 13, 14] and speculator.plan([req])
    assert speculator.draft([req]) == 1 and req.draft_token_ids == [12, 13, 14]
    speculator.judged(req, 3, 1)  # a kept token: the misses start again from 0
    assert req.draft_misses == 0 and speculator.stats.num_accepted_tokens == 1
    req.drop_drafts(keep=1)
    speculator.judged(req, 3, 0)  # a draft rejected whole is a miss
    assert (req.draft_misses, req.draft_pause) == (1, 2)


def test_a_draft_models_sequences_never_pause() -> None:
    """A draft rejected whole pauses a prompt-lookup sequence, never a draft model's: its next step
    still wants a draft (the proposal's rounds cost the step the same with it or without)."""
    from pagoda.service.engine.core.speculation import Speculator

    config = SpeculativeConfig(method="draft_model", model="/models/draft")
    speculator = Speculator(config, max_model_len=1000, propose=lambda reqs, k: [[7] * n for n in k])
    req = Request("d", [1, 2, 3, 4, 5], SamplingParams(), 0.0)
    for _ in range(3):
        speculator.judged(req, 3, 0)
        assert (req.draft_misses, req.draft_pause) == (0, 0)
        req.token_ids.append(9)
        speculator.after_token(req, num_running=1)
        req.num_computed_tokens = req.num_tokens - 1  # decoding
        assert req.wants_draft and speculator.plan([req])
    assert speculator.stats.num_drafts == 3 and speculator.stats.num_accepted_tokens == 0


def test_no_lookup_where_the_load_rule_forbids_drafts() -> None:
    from pagoda.service.engine.core.speculation import Speculator

    speculator = Speculator(SpeculativeConfig(max_batch_tokens=8), max_model_len=1000)
    req = Request("p", [1, 2, 1, 2, 1], SamplingParams(), 0.0)
    speculator.after_token(req, num_running=5)  # 8 // 5 - 1 = 0 drafts each
    assert speculator.lookups == 0 and req.draft_proposal == []
    three = [Request(f"p{i}", [1, 2, 1, 2, 1], SamplingParams(), 0.0) for i in range(3)]
    for r in three:
        r.num_computed_tokens = 4  # decoding
        speculator.after_token(r, num_running=3)  # 8 // 3 - 1 = 1
    assert speculator.lookups == 3 and three[0].draft_proposal == [2, 1]
    assert speculator.plan(three)  # one draft each is still a drafting step
    assert speculator.draft(three) == 3 and [r.draft_token_ids for r in three] == [[2]] * 3  # cut to one
    assert not any(r.wants_draft for r in three)  # until their next lookups: the next step does not draft
    logprobs = Request("q", [1, 2, 1, 2, 1], SamplingParams(logprobs=1), 0.0)
    speculator.after_token(logprobs, num_running=1)
    assert logprobs.draft_proposal == [] and speculator.lookups == 3  # never drafts: never looked up
    logprobs.num_computed_tokens = logprobs.num_tokens - 1
    assert not logprobs.wants_draft and not speculator.plan([logprobs])
    # Drafts found while the batch was small, then more sequences decode: the load rule now says none.
    five = [*three, *(Request(f"n{i}", [1, 2, 1, 2, 1], SamplingParams(), 0.0) for i in range(2))]
    for r in five:
        r.num_computed_tokens, r.wants_draft = r.num_tokens - 1, True  # 8 // 5 - 1 = 0 drafts each
    assert not speculator.plan(five)
    assert speculator.plan(five[:3])  # three decoding: one draft each


def test_only_decoding_sequences_draft_and_never_past_max_tokens() -> None:
    """Sequences with one token to compute draft; a prompt still in chunks (here more than half computed)
    neither drafts nor counts in the load rule; a draft stops one short of max_tokens (the last kept row
    samples the last token). Token counts even and odd."""
    from pagoda.service.engine.core.speculation import Speculator

    speculator = Speculator(
        SpeculativeConfig(num_speculative_tokens=4, max_batch_tokens=4), max_model_len=1000
    )
    even = Request("even", [1, 2, 3] * 4, SamplingParams(), 0.0)  # 12 tokens, the last one to compute
    even.num_computed_tokens = 11
    speculator.after_token(even, num_running=1)
    assert even.draft_proposal == [1, 2, 3, 1]  # "3 1 2 3" last at 2 with four after it
    chunked = [Request(f"c{i}", list(range(3, 23)), SamplingParams(), 0.0) for i in range(2)]
    for r in chunked:
        r.num_computed_tokens, r.wants_draft, r.draft_proposal = 12, True, [5, 5]  # 8 prompt tokens left
    running = [even, *chunked]
    assert speculator.plan(running)  # one decoding sequence: 4 // 1 - 1 = 3 drafts
    assert speculator.draft(running) == 1
    assert even.draft_token_ids == [1, 2, 3] and [r.num_drafts for r in chunked] == [0, 0]

    short = Speculator(SpeculativeConfig(num_speculative_tokens=4), max_model_len=1000)
    capped = Request("capped", [1, 2, 3] * 4, SamplingParams(max_tokens=4), 0.0)
    capped.num_computed_tokens = 11
    short.after_token(capped, num_running=1)
    assert short.draft([capped]) == 1 and capped.draft_token_ids == [1, 2, 3]  # 4 - 0 outputs - 1


def test_a_draft_models_speculator_needs_its_proposer_and_prompt_lookup_none() -> None:
    from pagoda.service.engine.core.speculation import Speculator

    draft = SpeculativeConfig.from_json('{"model": "/models/draft", "num_speculative_tokens": 2}')
    with pytest.raises(ValueError, match="takes its proposer"):
        Speculator(draft, max_model_len=100)
    with pytest.raises(ValueError, match="takes its proposer"):
        Speculator(SpeculativeConfig(**NGRAM), max_model_len=100, propose=lambda reqs, k: [[]] * len(reqs))  # type: ignore[arg-type]
    assert Speculator(draft, max_model_len=100, propose=lambda reqs, k: [[]] * len(reqs)).propose is not None


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(presence_penalty=0.5),
        SamplingParams(presence_penalty=-0.5),
        SamplingParams(frequency_penalty=-0.5),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(repetition_penalty=0.9),
        SamplingParams(repetition_penalty=1.1),
        SamplingParams(logprobs=0),
        SamplingParams(prompt_logprobs=0),
    ],
)
def test_what_reads_the_history_or_log_probabilities_never_drafts(params: SamplingParams) -> None:
    from pagoda.service.engine.core.speculation import can_draft

    assert can_draft(Request("q", [1, 2], SamplingParams(), 0.0))
    assert not can_draft(Request("q", [1, 2], params, 0.0))


def test_a_draft_model_proposer_fills_the_slots_the_load_rule_gives() -> None:
    """A draft model's speculator: every decoding sequence wants a draft (no lookup, no grammar check),
    `draft` holds the load rule's number of zero slots, and `fill` writes the proposer's tokens there."""
    from pagoda.service.engine.core.speculation import Speculator

    asked: list[list[int]] = []

    def propose(reqs: list[Request], k: list[int]) -> list[list[int]]:
        asked.append(k)
        return [[40 + i] * n for i, n in enumerate(k)]

    config = SpeculativeConfig(method="draft_model", model="draft", max_batch_tokens=8, adaptive=False)
    speculator = Speculator(config, max_model_len=1000, propose=propose, valid_drafts=lambda r, t: 0)
    assert speculator.valid_drafts is None  # a draft model's drafts are not cut by a grammar
    two = [Request(f"d{i}", [1, 2, 3], SamplingParams(), 0.0) for i in range(2)]
    for r in two:
        r.num_computed_tokens = 2
        speculator.after_token(r, num_running=2)  # 8 // 2 - 1 = 3 drafts each
    prefilling = Request("p", list(range(7)), SamplingParams(), 0.0)
    prefilling.num_computed_tokens = 3  # mid-prompt: neither decoding nor drafting
    running = [*two, prefilling]
    assert speculator.lookups == 0 and all(r.wants_draft for r in two) and speculator.plan(running)
    assert speculator.draft(running) == 2 and [r.draft_token_ids for r in two] == [[0, 0, 0]] * 2
    speculator.fill(two)
    assert asked == [[3, 3]] and [r.token_ids for r in two] == [[1, 2, 3, 40, 40, 40], [1, 2, 3, 41, 41, 41]]
    assert prefilling.token_ids == list(range(7))
    four = [Request(f"e{i}", [1, 2, 3], SamplingParams(), 0.0) for i in range(4)]
    for r in four:
        r.num_computed_tokens = 2
        speculator.after_token(r, num_running=4)  # 8 // 4 - 1 = 1 draft each
    assert speculator.plan([*four, prefilling])  # the prompt's rows are not a fifth drafter (8 // 5 - 1 = 0)
    with pytest.raises(ValueError, match="proposer"):
        Speculator(SpeculativeConfig(), max_model_len=1000, propose=propose)


def test_tensor_parallel_drafts_give_the_single_rank_output(llama_ckpt: Path) -> None:
    """Under TP 2 (gloo) every rank runs the drafting step's k + 1 rows per sequence; greedy output
    (with an n = 2 request beside: its forks draft too) is rank-count and speculation invariant."""
    prompts = [[5, 6, 7, 8] * 5, *_repetitive_prompts(3)[:2]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    ]
    common: dict[str, Any] = {"dtype": "float32", "kv_cache_memory_bytes": 8 << 20}
    plain = [
        [c.token_ids for c in o.outputs] for o in LLM(str(llama_ckpt), **common).generate(prompts, params)
    ]
    with LLM(str(llama_ckpt), speculative_config=NGRAM, tensor_parallel_size=2, **common) as tp2:
        drafted = [[c.token_ids for c in o.outputs] for o in tp2.generate(prompts, params)]
        assert _spec_stats(tp2).spec_num_accepted_tokens_total > 5
    assert drafted == plain


def test_a_grammar_cuts_drafts_and_masks_each_verified_position(smollm2_gguf: Path) -> None:
    """Structured output's side: a draft is cut at the first token its grammar refuses (and before an
    end-of-sequence token); a sequence with k drafts gets k + 1 mask rows, each the grammar's after
    the drafts before it, and its matcher is where it was afterwards."""
    from pagoda.service.engine.core.scheduler import SchedulerOutput
    from pagoda.service.engine.core.structured_output import StructuredOutputManager
    from pagoda.service.grammar import Grammar
    from pagoda.service.model import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2_gguf))
    eos = min(tokenizer.eos_token_ids)
    manager = StructuredOutputManager(lambda: tokenizer, tokenizer.eos_token_ids)
    seq = Request("c#0", [1, 2, 3], SamplingParams(temperature=0.0), 0.0)
    manager.add("c", [seq], Grammar.regex("(ab|cd)[0-9]{2}", "guided_regex"))
    manager.wait(30.0)
    assert manager.take_ready() == ([seq], {})
    ab, cd, digit_4, digit_7 = (tokenizer.encode(t, add_special_tokens=False) for t in ("ab", "cd", "4", "7"))
    assert all(len(t) == 1 for t in (ab, cd, digit_4, digit_7))
    assert manager.valid_drafts(seq, [*ab, *digit_4, *digit_7]) == 3
    assert manager.valid_drafts(seq, [*ab, *cd, *digit_4]) == 1  # cd is not allowed after ab
    assert manager.valid_drafts(seq, [*cd, eos, *digit_4]) == 1  # never an end-of-sequence draft
    assert manager.valid_drafts(seq, [*digit_7]) == 0

    seq.token_ids.append(0)  # the step's input row, then two drafts
    seq.num_computed_tokens = 3
    seq.add_drafts([*ab, *digit_4])
    out = SchedulerOutput([seq], [3])
    masks = manager.bitmask(out)
    assert masks is not None and masks.rows == [0, 0, 0] and masks.positions == [0, 1, 2]
    allowed = [
        {t for t in (*ab, *cd, *digit_4, *digit_7) if masks.bitmask[r, t // 32] >> (t % 32) & 1}
        for r in range(3)
    ]
    assert allowed == [{*ab, *cd}, {*digit_4, *digit_7}, {*digit_4, *digit_7}]
    seq.drop_drafts()
    again = manager.bitmask(SchedulerOutput([seq], [1]))  # rolled back: the first position's mask
    assert again is not None and again.positions == [] and (again.bitmask[0] == masks.bitmask[0]).all()


def _colour_list(tokens: int) -> tuple[str, Any]:
    from pagoda.service.grammar import Grammar

    pattern = f"(red|green|blue) [0-9]( (red|green|blue) [0-9]){{{tokens}}}"
    return pattern, Grammar.regex(pattern, "guided_regex")


@pytest.fixture(scope="module")
def smollm2_ngram() -> Iterator[LLM]:
    """The embedded SmolLM2 in fp32 with prompt lookup, for the two tests that need the real model (one
    load of 135M weights, not three): each takes its reference outputs from it with drafting off
    (`_without_drafts`) and counts drafts from its own starting point."""
    with LLM(
        max_model_len=256, dtype="float32", kv_cache_memory_bytes=32 << 20, speculative_config=NGRAM
    ) as llm:
        yield llm


@contextlib.contextmanager
def _without_drafts(llm: LLM) -> Iterator[None]:
    speculator = llm.engine.core.speculator
    llm.engine.core.speculator = None
    try:
        yield
    finally:
        llm.engine.core.speculator = speculator


def test_a_grammar_request_drafts_under_its_grammar_beside_others(smollm2_ngram: LLM) -> None:
    """Structured output drafts by prompt lookup, drafts cut to what the grammar allows and each
    verified position masked by the grammar after the drafts before it: a colour list the real model
    copies (words and digits alternate, so a mask on the wrong row changes the output), alone and in
    a batch with plain drafting requests; greedy output is the same as without speculation."""
    llm = smollm2_ngram
    pattern, colours = _colour_list(11)
    kept_before = _spec_stats(llm).spec_num_accepted_tokens_total
    listed = "red 1 green 2 blue 3 red 4 green 5 blue 6\n" * 3
    params = SamplingParams(temperature=0, max_tokens=60, grammar=colours)
    alone = llm.generate([listed], params)[0].outputs[0]
    stats = _spec_stats(llm)
    assert stats.spec_num_accepted_tokens_total >= kept_before + 8, (
        stats
    )  # the grammar request drafted, kept some
    assert re.fullmatch(pattern, alone.text), alone.text

    copy = "one two three four one two three four one two three four one two three"
    prompts = [copy, listed, copy + " four"]
    mixed = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        params,
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    ]
    outs = llm.generate(prompts, mixed)
    assert _spec_stats(llm).spec_num_accepted_tokens_total > stats.spec_num_accepted_tokens_total + 5
    with _without_drafts(llm):
        plain = llm.generate(prompts, mixed)
    assert outs[1].outputs[0].token_ids == alone.token_ids
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_pagoda_serve_drafts_through_the_openai_client(llama_ckpt: Path, tmp_path: Path) -> None:
    """`pagoda serve --speculative-config`: streamed and whole completions are the offline engine's
    text without drafts, and /metrics counts the kept drafts under vLLM's names."""
    import httpx
    import openai

    from pagoda.service.serve_process import ServeProcess

    prompt = [5, 6, 7, 8] * 5
    extra = {"ignore_eos": True}
    expected = (
        LLM(str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20)
        .generate([prompt], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))[0]
        .outputs[0]
    )
    args = [
        "--model",
        str(llama_ckpt),
        "--served-model-name",
        "tiny",
        "--kv-cache-memory-bytes",
        str(8 << 20),
    ]
    args += ["--speculative-config", json.dumps(NGRAM)]
    with ServeProcess(args, log_path=tmp_path / "serve.log") as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        whole = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=32, temperature=0, extra_body=extra
        )
        stream = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=32, temperature=0, extra_body=extra, stream=True
        )
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        metrics = httpx.get(f"{server.base_url}/metrics").text
    assert whole.choices[0].text == streamed == expected.text
    assert whole.usage is not None and whole.usage.completion_tokens == 32
    kept = re.search(
        r'^vllm:spec_decode_num_accepted_tokens_total\{model_name="tiny"\} (\S+)$', metrics, re.M
    )
    assert kept is not None and float(kept.group(1)) > 10, metrics


@pytest.mark.parametrize(
    ("draft_name", "async_scheduling", "tp"),
    [("llama_ckpt", False, 1), ("qwen2_ckpt", True, 1), ("llama_ckpt", False, 2)],
    ids=["the-target-itself", "another-model-async", "tp2"],
)
def test_a_draft_model_gives_the_target_output(
    llama_ckpt: Path, draft_name: str, async_scheduling: bool, tp: int, request: pytest.FixtureRequest
) -> None:
    """`{"model": DRAFT}`: the target as its own draft keeps every draft (its KV cache, fed by the
    shadow runs, is the target's); another model keeps few. Greedy output is the target's either way,
    over chunked prefill, an n = 2 request (forks), a logprobs request that never drafts, and seeded
    sampling that reproduces."""
    draft: Path = request.getfixturevalue(draft_name)
    config = {"model": str(draft), "num_speculative_tokens": 3, "adaptive": False}
    common: dict[str, Any] = {
        "dtype": "float32", "kv_cache_memory_bytes": 8 << 20, "max_num_batched_tokens": 32,
        "async_scheduling": async_scheduling,
    }  # fmt: skip
    prompts = [[5, 6, 7, 8] * 5, *_repetitive_prompts(4)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, n=2),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    ]
    expected = [
        [c.token_ids for c in o.outputs] for o in LLM(str(llama_ckpt), **common).generate(prompts, params)
    ]
    with LLM(str(llama_ckpt), speculative_config=config, tensor_parallel_size=tp, **common) as spec:
        got = [[c.token_ids for c in o.outputs] for o in spec.generate(prompts, params)]
        stats = _spec_stats(spec)
        seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
        twice = [spec.generate(prompts[0], seeded)[0].outputs[0].token_ids for _ in range(2)]
        bm = spec.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        kv = spec.engine.runner.kv
    assert got == expected
    assert twice[0] == twice[1] and len(twice[0]) == 20
    if draft_name == "llama_ckpt":  # each block is paid for the target's shard and the whole draft's
        assert kv.num_blocks == (8 << 20) // ((1 + tp) * kv.bytes_per_block), kv  # (unsharded: TP x)
    if draft_name == "llama_ckpt":
        assert stats.spec_num_accepted_tokens_total == stats.spec_num_draft_tokens_total > 30, stats
    else:
        assert stats.spec_num_draft_tokens_total > 0, stats


def test_the_warm_up_runs_its_prompt_batches_and_decode_variants_through_the_draft_model(
    llama_ckpt: Path, qwen2_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draft model of other shapes compiles kernel variants of its own: the warm-up (a GPU's, called
    here by hand) shadows its prompt batches through the draft and hands the draft's first layer to
    the decode-variant warm-up as well as the target's. It writes no KV: greedy drafting output after it
    is the target's."""
    from pagoda.service.engine.runner.draft_model import DraftModel
    from pagoda.service.engine.runner.model_runner import warm_up_query_lens
    from pagoda.service.model.attention import PagedAttention

    config = {"model": str(qwen2_ckpt), "num_speculative_tokens": 3, "adaptive": False}
    common: dict[str, Any] = {
        "dtype": "float32",
        "kv_cache_memory_bytes": 8 << 20,
        "max_num_batched_tokens": 64,
    }
    prompts = [[5, 6, 7, 8] * 5]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = LLM(str(llama_ckpt), **common).generate(prompts, params)[0].outputs[0].token_ids
    with LLM(str(llama_ckpt), speculative_config=config, **common) as spec:
        runner = spec.engine.core.executor.runner
        shadowed: list[int] = []
        real_shadow = DraftModel.shadow
        monkeypatch.setattr(
            DraftModel,
            "shadow",
            lambda self, batch, fill: (
                shadowed.append(len(batch["input_ids"])) or real_shadow(self, batch, fill)
            ),
        )
        layers: list[PagedAttention] = []
        monkeypatch.setattr(
            PagedAttention, "compile_decode_variants", lambda self, *a: layers.append(self) or []
        )
        runner._warm_up()
        assert shadowed == [sum(lens) for lens in warm_up_query_lens(64)]
        assert layers == [runner.model.attention_layers()[0], runner.draft.model.attention_layers()[0]]
        assert spec.generate(prompts, params)[0].outputs[0].token_ids == want


def test_a_verify_step_shadows_only_the_rows_the_proposal_did_not_write() -> None:
    """A prompt chunk (5 rows, not sampled), a sequence with 3 drafts (its last real token at 9, drafts
    at 10-12) and a plain decode: the draft's shadow run keeps the chunk, the drafting sequence's last
    row (position 12: its proposal rounds wrote 9-11) and the decode, at the same context lengths."""
    import numpy as np

    from pagoda.service.engine.runner.draft_model import rows_it_lacks

    batch = {
        "input_ids": np.arange(100, 110),
        "positions": np.array([0, 1, 2, 3, 4, 9, 10, 11, 12, 6]),
        "slot_mapping": np.arange(200, 210),
        "query_start_loc": np.array([0, 5, 9, 10]),
        "seq_lens": np.array([5, 13, 7]),
        "block_tables": np.arange(6).reshape(3, 2),
        "max_query_len": np.asarray(5),
    }
    sub = rows_it_lacks(batch, [1, 2], [3, 0])
    assert sub["input_ids"].tolist() == [100, 101, 102, 103, 104, 108, 109]
    assert sub["positions"].tolist() == [0, 1, 2, 3, 4, 12, 6]
    assert sub["slot_mapping"].tolist() == [200, 201, 202, 203, 204, 208, 209]
    assert sub["query_start_loc"].tolist() == [0, 5, 6, 7] and int(sub["max_query_len"]) == 5
    assert sub["seq_lens"] is batch["seq_lens"] and sub["block_tables"] is batch["block_tables"]
    decodes = rows_it_lacks({**batch, "query_start_loc": np.array([0, 4, 8, 10])}, [0, 1, 2], [3, 3, 1])
    assert decodes["input_ids"].tolist() == [103, 107, 109] and int(decodes["max_query_len"]) == 1


def test_a_shadow_run_takes_the_decode_graph_the_mixed_graph_or_runs_eagerly() -> None:
    """`DraftModel.shadow` by the batch's shape: one token a sequence replays the decode ladder, other
    batches that fit the mixed ladder replay it (computing no logits), the rest run eagerly. Test doubles
    stand in for the graphs and the model (only the choice is under test; the paths' outputs are the
    engine tests')."""
    import numpy as np

    from pagoda.service.engine.runner.draft_model import DraftModel

    calls: list[tuple[str, int]] = []

    class Graphs:  # a test double of StepGraphs
        max_batch_size = 4

        def run(self, input_ids: Any, *rest: Any) -> None:
            calls.append(("decode", len(input_ids)))

        def fits_mixed(self, num_tokens: int, num_seqs: int) -> bool:
            return num_tokens <= 8

        def run_mixed(self, batch: Any, logits_rows: Any, fill: Any) -> None:
            calls.append(("mixed", len(logits_rows)))

    def model(input_ids: Any, positions: Any, meta: Any) -> None:  # a test double of the draft's model
        calls.append(("eager", len(input_ids)))

    draft = DraftModel.__new__(DraftModel)
    draft.graphs, draft.model, draft.device = Graphs(), model, torch.device("cpu")  # type: ignore[assignment]

    def batch(query_lens: list[int]) -> dict[str, Any]:
        qsl = np.concatenate([[0], np.cumsum(query_lens)])
        n = int(qsl[-1])
        return {
            "input_ids": np.zeros(n, dtype=np.int64), "positions": np.arange(n), "slot_mapping": np.arange(n),
            "seq_lens": np.asarray(query_lens) + 5, "block_tables": np.zeros((len(query_lens), 1), np.int32),
            "query_start_loc": qsl, "max_query_len": np.asarray(max(query_lens)),
        }  # fmt: skip

    for lens in ([1, 1, 1], [1, 1, 1, 1], [1] * 5, [1, 3], [8], [9], [2, 1, 1, 1]):
        draft.shadow(batch(lens), None)
    assert calls == [
        ("decode", 3), ("decode", 4), ("mixed", 0), ("mixed", 0), ("mixed", 0), ("eager", 9), ("mixed", 0)
    ]  # fmt: skip
    draft.graphs = None
    draft.shadow(batch([1, 1]), None)
    assert calls[-1] == ("eager", 2)


def test_a_proposal_replays_the_decode_ladder_round_by_round() -> None:
    """`DraftModel.propose` on a test double of its graphs (a "model" whose greedy token is its input
    + 1): k = [3, 1, 2, 4] runs rounds of 4, 3, 2 and 1 rows, each replayed from the decode ladder with
    the round's tokens filled in on the device (4 rows: exactly the largest graph), and returns each
    sequence's chain; a round larger than the ladder runs eagerly."""
    from types import SimpleNamespace

    import numpy as np

    from pagoda.service.engine.runner.draft_model import DraftModel

    vocab, rounds = 50, []

    class Graphs:  # a test double of StepGraphs
        max_batch_size = 4

        def run(
            self, input_ids: Any, positions: Any, slots: Any, seq_lens: Any, tables: Any, fill: Any
        ) -> Any:
            ids = torch.zeros(len(input_ids), dtype=torch.int64)
            fill(ids)
            rounds.append((ids.tolist(), positions.tolist(), seq_lens.tolist()))
            return torch.nn.functional.one_hot((ids + 1) % vocab, vocab).float()

    def eager(*args: Any) -> Any:
        raise AssertionError("a round that fits the ladder ran eagerly")

    draft = DraftModel.__new__(DraftModel)
    draft.graphs, draft.model = Graphs(), eager  # type: ignore[assignment]
    draft.device, draft.block_size = torch.device("cpu"), 16
    reqs = [
        SimpleNamespace(token_ids=t, num_tokens=len(t), num_drafts=0) for t in ([4, 5], [8, 9], [1], [6, 7])
    ]
    tables = np.arange(8, dtype=np.int32).reshape(4, 2)
    drafts = draft.propose(reqs, tables, [3, 1, 2, 4])  # type: ignore[arg-type]
    assert drafts == [[6, 7, 8], [10], [2, 3], [8, 9, 10, 11]]
    assert rounds == [
        ([5, 9, 1, 7], [1, 1, 0, 1], [2, 2, 1, 2]),
        ([6, 2, 8], [2, 1, 2], [3, 2, 3]),
        ([7, 9], [3, 3], [4, 4]),
        ([10], [4], [5]),
    ]
    draft.graphs.max_batch_size = 3  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="ran eagerly"):
        draft.propose(reqs, tables, [1, 1, 1, 1])  # type: ignore[arg-type]


def _counted(f: Any, calls: dict[str, int], name: str) -> Any:
    def counting(*args: Any) -> Any:
        calls[name] += 1
        return f(*args)

    return counting


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[Any, Any]:
    """Each prompt's tokens and the speculation stats. (A step that raises fails the test:
    tests/conftest.py's `_steps_do_not_fail_quietly`.)"""
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], _spec_stats(llm)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["in-turn", "async"])
def test_a_draft_model_through_its_graph_paths_keeps_every_draft(
    llama_ckpt: Path, async_scheduling: bool
) -> None:
    """The draft model's CUDA-graph paths on the CPU (`StepGraphs(capture=False)`: the same padded
    forwards over the same static buffers as a replay): the target as its own draft still keeps every
    draft and gives the target's output, so each proposal round (the decode ladder; fewer rows near
    max_tokens) and each shadow run (decode steps, verify and prefill steps in the mixed ladder, with the
    previous step's tokens filled in on the device under async scheduling) wrote the KV the eager
    forwards would."""
    common: dict[str, Any] = {
        "dtype": "float32", "kv_cache_memory_bytes": 8 << 20, "max_num_batched_tokens": 128,
        "async_scheduling": async_scheduling,
    }  # fmt: skip
    # the long prompt's later chunks run beside the others' first drafting steps: mixed shadow runs of a
    # chunk and the drafting sequences' last rows (`rows_it_lacks`)
    prompts = [[5, 6, 7, 8] * 5, *_repetitive_prompts(5), list(range(100, 400))]
    # Unequal lengths: near each one's end its drafts are cut short (never past max_tokens), so a
    # proposal's later rounds run fewer rows than its first.
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 31, 33, 29, 32)]
    expected = [o.outputs[0].token_ids for o in LLM(str(llama_ckpt), **common).generate(prompts, params)]
    config = {"model": str(llama_ckpt), "num_speculative_tokens": 3, "adaptive": False}
    with LLM(str(llama_ckpt), speculative_config=config, **common) as spec:
        runner = spec.engine.runner.runner  # the executor's, in this process at one rank
        calls = {"run": 0, "run_mixed": 0, "eager": 0}
        graphs = runner.step_graphs(runner.draft.model, None, capture=False)
        for name in ("run", "run_mixed"):
            setattr(graphs, name, _counted(getattr(graphs, name), calls, name))
        runner.draft.use_graphs(graphs)
        # The graphs hold the model itself; calls through the draft's own reference are eager forwards.
        runner.draft.model = _counted(runner.draft.model, calls, "eager")
        got, stats = _generate(spec, prompts, params)
    assert got == expected
    assert stats.spec_num_accepted_tokens_total == stats.spec_num_draft_tokens_total > 30, stats
    # Every step fits a ladder (at most 128 tokens, at most 5 sequences): nothing runs eagerly.
    assert calls["run"] > 10 and calls["run_mixed"] > 3 and calls["eager"] == 0, calls


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["in-turn", "async"])
def test_verify_steps_replay_the_mixed_graphs_past_one_logit_row_a_sequence(
    llama_ckpt: Path, async_scheduling: bool
) -> None:
    """A verify step scores 1 + k rows of each drafting sequence: more rows than the mixed graphs'
    one logit row a sequence (`max_num_seqs`). It still replays the mixed ladder (its logits from the
    graph's hidden states), never an eager forward of the whole step: on the GPU machine that forward's
    host launches were a third of a drafting step at batch 32. On the CPU (`StepGraphs(capture=False)`,
    the replays' padded forwards), the target as its own draft keeps every draft and gives the output
    without speculation."""
    common: dict[str, Any] = {
        "dtype": "float32", "kv_cache_memory_bytes": 8 << 20, "max_num_batched_tokens": 128,
        "max_num_seqs": 5, "async_scheduling": async_scheduling,
    }  # fmt: skip
    # the long prompt's later chunks run beside the others' verify steps: rows the step does not score
    prompts = [[5, 6, 7, 8] * 5, *_repetitive_prompts(7), list(range(100, 400))]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 25, 27, 23, 26)]
    expected = [o.outputs[0].token_ids for o in LLM(str(llama_ckpt), **common).generate(prompts, params)]
    config = {"model": str(llama_ckpt), "num_speculative_tokens": 3, "adaptive": False}
    with LLM(str(llama_ckpt), speculative_config=config, **common) as spec:
        runner = spec.engine.runner.runner
        runner.graphs = runner.step_graphs(runner.model, None, capture=False)
        seen = {"overflowing replays": 0, "eager verify steps": 0}
        run_mixed, forward_target, forward_eager = (
            runner.graphs.run_mixed,
            runner._forward_target,
            runner._forward_eager,
        )
        eager: list[int] = []

        def counting_run_mixed(batch: Any, logits_rows: Any, *rest: Any) -> Any:
            seen["overflowing replays"] += len(logits_rows) > common["max_num_seqs"]
            return run_mixed(batch, logits_rows, *rest)

        def counting_forward_eager(*args: Any) -> Any:
            eager.append(1)
            return forward_eager(*args)

        def counting_forward_target(step: Any, fill: Any) -> Any:
            before = len(eager)
            out = forward_target(step, fill)
            seen["eager verify steps"] += any(step.num_drafts) and len(eager) > before
            return out

        runner.graphs.run_mixed = counting_run_mixed  # type: ignore[method-assign]
        runner._forward_eager = counting_forward_eager  # type: ignore[method-assign]
        runner._forward_target = counting_forward_target  # type: ignore[method-assign]
        got, stats = _generate(spec, prompts, params)
    assert got == expected
    assert stats.spec_num_accepted_tokens_total == stats.spec_num_draft_tokens_total > 30, stats
    assert seen["overflowing replays"] > 3 and seen["eager verify steps"] == 0, seen


def test_a_draft_model_of_another_vocabulary_is_refused(llama_ckpt: Path, tmp_path: Path) -> None:
    import shutil

    other = tmp_path / "other"
    shutil.copytree(llama_ckpt, other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = 1000
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"vocabulary \(1000 tokens\) is not the target's \(49152\)"):
        LLM(str(llama_ckpt), dtype="float32", speculative_config={"model": str(other)})
    from types import SimpleNamespace

    from pagoda.service.engine.runner.draft_model import DraftModel

    draft = DraftModel.__new__(DraftModel)  # the check alone: a larger vocabulary is refused too
    draft.config = SimpleNamespace(vocab_size=50000)  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"vocabulary \(50000 tokens\) is not the target's \(49152\)"):
        draft.check_vocabulary(SimpleNamespace(vocab_size=49152))  # type: ignore[arg-type]
    draft.check_vocabulary(SimpleNamespace(vocab_size=50000))  # type: ignore[arg-type]


def test_step_rates_decide_by_batch_bucket_and_keep_exploring() -> None:
    from pagoda.service.engine.core.speculation import EXPLORE_EVERY, StepRates

    rates = StepRates()
    assert rates.worth_drafting(8)  # nothing measured: draft, and measure
    rates.record(8, drafted=True, tokens=20, seconds=0.020)  # 1,000 tok/s
    assert not rates.worth_drafting(8)  # plain steps unmeasured: take one
    rates = StepRates()
    rates.record(8, drafted=False, tokens=8, seconds=0.010)  # 800 tok/s
    assert rates.worth_drafting(8)  # drafting at 8 still unmeasured
    rates.record(2, drafted=False, tokens=2, seconds=0.010)
    rates.record(2, drafted=True, tokens=2, seconds=0.010)
    assert all(rates.worth_drafting(2) for _ in range(EXPLORE_EVERY))  # as fast: drafting, every step
    rates.record(8, drafted=True, tokens=20, seconds=0.020)  # 1,000 tok/s: drafting pays
    assert rates.worth_drafting(8) and rates.worth_drafting(15)  # 8-15 is one bucket
    assert rates.worth_drafting(64)  # another bucket, nothing measured there
    rates.record(64, drafted=False, tokens=64, seconds=0.010)  # 6,400 tok/s
    rates.record(64, drafted=True, tokens=128, seconds=0.025)  # 5,120 tok/s: it does not
    decisions = [rates.worth_drafting(64) for _ in range(3 * EXPLORE_EVERY)]
    assert decisions.count(True) == 3 and decisions[EXPLORE_EVERY - 1]  # one step in 32 explores
    # Drafting gets cheaper (a copy-heavy stretch): the average follows and drafting resumes.
    for _ in range(10):
        rates.record(64, drafted=True, tokens=256, seconds=0.025)  # 10,240 tok/s
    assert rates.worth_drafting(64)
    assert rates.rate(64, True) == pytest.approx(10_240, rel=0.2) and rates.rate(64, False) == 6_400
    assert rates.worth_drafting(9)  # bucket 8-15 unaffected


class _SimulatedGPU:
    """A test double for a GPU's timing (there is none here): each step's forward pass runs on a
    simulated device for `decode_s`, or `draft_s` when some sequence drafted, one step after another;
    its tokens are ready when the device is done, and the core waiting for them moves the clock, which
    stands in for the core's `time`; `host_s`: the host's preparation of each step, before its launch.
    Every token is 7, so prompt lookup drafts 7s and keeps them all."""

    can_overlap = True
    max_model_len = 4096

    def __init__(self, decode_s: float, draft_s: float, host_s: float = 0.0) -> None:
        from pagoda.service.engine.runner.model_runner import KVCacheLayout

        self.decode_s, self.draft_s, self.host_s = decode_s, draft_s, host_s
        self.now = self.free_at = 0.0
        self.kv = KVCacheLayout(256, 16, 1)
        self.steps = {True: 0, False: 0}  # pure decode steps that drafted / did not

    def monotonic(self) -> float:
        return self.now

    def forward(self, out: Any, after: object = None) -> tuple[Any, float]:
        from pagoda.service.engine.messages import SampleResult
        from pagoda.service.engine.runner.model_runner import StepResult

        self.now += self.host_s  # the host prepares the step, then launches it
        drafted = any(r.num_drafts for r in out.requests)
        if out.total_num_tokens == len(out.requests) + sum(r.num_drafts for r in out.requests):
            self.steps[drafted] += 1
        self.free_at = max(self.now, self.free_at) + (self.draft_s if drafted else self.decode_s)
        sampled = {r.request_id: SampleResult(7) for i, r in enumerate(out.requests) if out.needs_sample(i)}
        accepted = {r.request_id: r.num_drafts for r in out.requests if r.num_drafts}
        return StepResult(sampled, {}, accepted), self.free_at

    def sample(self, forwarded: tuple[Any, float], grammar: object = None) -> Any:
        result, done_at = forwarded
        gpu = self

        class Pending:
            def result(self) -> Any:
                gpu.now = max(gpu.now, done_at)
                return result

        return Pending()

    def check_alive(self) -> None:
        pass


@pytest.mark.parametrize(("draft_s", "host_s"), [(0.030, 0.0), (0.012, 0.0), (0.024, 0.003)])
def test_step_rates_time_each_step_from_the_completion_before_it(
    draft_s: float, host_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a simulated device (5 ms a plain decode step, `draft_s` a drafting one, 4 tokens a sequence:
    every draft kept) the core's rates are each step's device time: a drafting step after an async
    one waits for it first, and the plain step after drafting ones starts with nothing in flight, and
    neither carries the other's time. At 30 ms drafting loses (133 against 200 tok/s): one plain step
    measures that, then one step in 32 explores; at 12 ms (333 tok/s) nearly every step drafts. With
    3 ms of host work a step, a drafting step (in turn) takes 27 ms, 148 tok/s; plain steps overlap the
    host's work with the step before and run at 200, but the first after a drafting step pays it (8 ms,
    125 tok/s): timed, it would keep the losing drafts on."""
    from types import SimpleNamespace

    from pagoda.service.engine.core import engine_core
    from pagoda.service.engine.messages import AddRequest

    gpu = _SimulatedGPU(0.005, draft_s, host_s)
    monkeypatch.setattr(engine_core, "time", SimpleNamespace(monotonic=gpu.monotonic))
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2)
    core = engine_core.EngineCore(EngineConfig(speculative=spec, async_scheduling=True), gpu, {0})  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    core.add_request(AddRequest("r", [7] * 8, params, 0.0))
    while core.generation_tokens_total < 300:  # short of max_tokens, where drafts get shorter
        core.step()
    assert core.speculator is not None
    rates = core.speculator.rates
    assert rates.rate(1, True) == pytest.approx(4 / (draft_s + host_s))
    assert rates.rate(1, False) == pytest.approx(200)
    if draft_s + host_s > 0.020:
        assert 3 <= gpu.steps[True] <= 12 and gpu.steps[False] > 250, gpu.steps
    else:
        assert gpu.steps[False] <= 2 and gpu.steps[True] > 70, gpu.steps


def test_adaptive_speculation_keeps_greedy_output(llama_ckpt: Path) -> None:
    """With the measured rule on (the default) outputs stay the target's whatever it decides."""
    config = {"method": "ngram", "num_speculative_tokens": 3}
    common: dict[str, Any] = {"dtype": "float32", "kv_cache_memory_bytes": 8 << 20}
    prompts = [[5, 6, 7, 8] * 5, *_repetitive_prompts(5)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(llama_ckpt), **common).generate(prompts, params)]
    spec = LLM(str(llama_ckpt), speculative_config=config, **common)
    assert spec.engine.core.speculator is not None and spec.engine.core.speculator.config.adaptive
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == expected


@pytest.mark.parametrize("ckpt_name", ["qwen2_ckpt", "smollm2"])
def test_greedy_lookup_is_exact_on_other_checkpoints(ckpt_name: str, request: pytest.FixtureRequest) -> None:
    """fp32, prompt lookup against none: a random Qwen2 (bias on q/k/v) and the embedded SmolLM2, a
    real model, on a passage to repeat (where it copies, and drafts are kept). Qwen2's engine with
    drafting off, then on (the second run reads the prompts' cached blocks); SmolLM2's is shared."""
    if ckpt_name == "smollm2":
        spec = request.getfixturevalue("smollm2_ngram")
    else:
        common: dict[str, Any] = {"dtype": "float32", "kv_cache_memory_bytes": 16 << 20, "max_model_len": 512}
        spec = LLM(str(request.getfixturevalue(ckpt_name)), speculative_config=NGRAM, **common)
    passage = "The keeper trimmed the wick, polished the lens, and wrote the weather in his logbook."
    prompts = [f"Here is a passage.\n\n{passage}\n\nRepeat the passage word for word.\n\n", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with _without_drafts(spec):
        expected = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    before = _spec_stats(spec)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == expected
    if ckpt_name == "smollm2":  # the real model copies the passage: most drafts are kept
        stats = _spec_stats(spec)
        kept = stats.spec_num_accepted_tokens_total - before.spec_num_accepted_tokens_total
        drafted = stats.spec_num_draft_tokens_total - before.spec_num_draft_tokens_total
        assert kept >= 10, stats
        assert kept / drafted > 0.5, stats


def test_pagoda_bench_spec_table(llama_ckpt: Path, tmp_path: Path) -> None:
    """`pagoda bench spec` on the CPU: a row per workload and batch, the outputs with and without
    drafts the same; as an echo, after random prompts every draft is kept. `--busy-steps`: steady
    steps without drafts emit a token a sequence, drafting ones more."""
    from pagoda.bench import offline as bench

    out = tmp_path / "spec.md"
    args = ["spec", "--model", str(llama_ckpt), "--device", "cpu", "--dtype", "float32", "--echo",
            "--copy-batches", "1", "--random-batches", "2", "--input-len", "8", "--output-len", "12",
            "--busy-steps", "3", "--output", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    profiled = {
        m[1]: float(m[2])
        for m in re.finditer(r"^\| 2 \| (off|on) \|.*\| ([0-9.]+) \|$", out.read_text(), re.M)
    }
    assert profiled["off"] == 2.0 and profiled["on"] > 4.0, profiled
    rows = [
        line.split("|")[1:-1]
        for line in out.read_text().splitlines()
        if re.match(r"\| (copy|code|random) ", line)
    ]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("copy", "1"), ("code", "1"), ("random", "2")]
    for row in rows:
        kept, drafted = (int(x) for x in row[5].split("/"))
        assert 0 <= kept <= drafted and drafted > 0, row
        assert row[7].strip().startswith(f"{row[1].strip()}/{row[1].strip()}"), row  # outputs the same
    kept, drafted = (int(x) for x in rows[2][5].split("/"))
    assert kept == drafted  # random prompts: the echo repeats its last token, and every draft is that


def test_pagoda_bench_spec_with_the_target_as_its_draft_model(llama_ckpt: Path, tmp_path: Path) -> None:
    """`--draft-model`: the draft model drafts (the title names it), and the target as its own draft
    (fp32: greedy drafts are its tokens) has every draft kept, the output the same."""
    from pagoda.bench import offline as bench

    out = tmp_path / "spec.md"
    args = ["spec", "--model", str(llama_ckpt), "--draft-model", str(llama_ckpt), "--device", "cpu",
            "--dtype", "float32", "--copy-batches", "1", "--random-batches", "2", "--input-len", "8",
            "--output-len", "8", "--output", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    text = out.read_text()
    assert f"### speculative decoding ({llama_ckpt}, k=3" in text
    rows = [line.split("|")[1:-1] for line in text.splitlines() if re.match(r"\| (copy|code|random) ", line)]
    assert len(rows) == 3
    for row in rows:
        kept, drafted = (int(x) for x in row[5].split("/"))
        assert kept == drafted > 0, row
        assert row[7].strip().startswith(f"{row[1].strip()}/{row[1].strip()}"), row


def test_drafts_stop_short_of_max_tokens_and_the_context() -> None:
    from pagoda.service.engine.core.speculation import Speculator

    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=5, adaptive=False), max_model_len=12)

    def drafted(prompt: list[int], outputs: int, max_tokens: int | None) -> list[int]:
        req = Request("d", prompt, SamplingParams(max_tokens=max_tokens), 0.0)
        req.token_ids += [1] * outputs
        req.num_computed_tokens = req.num_tokens - 1
        req.draft_proposal, req.wants_draft = [7, 7, 7, 7, 7], True
        speculator.draft([req])
        return req.draft_token_ids

    assert drafted([1, 2], 1, 100) == [7] * 5  # room for all five
    assert drafted([1, 2], 1, 4) == [7, 7]  # 1 output + 2 drafts + the verifier's token = 4
    assert drafted([1, 2], 1, 2) == []  # the verifier's token is the last one allowed
    assert drafted([1, 2, 3, 4, 5, 6, 7], 1, None) == [7, 7, 7]  # 8 tokens + 3 + 1 = the context's 12
    assert drafted([1] * 10, 1, None) == []  # 11 tokens: the next is the context's last


def test_lookup_needs_every_token_of_the_suffix_and_stats_count_by_position() -> None:
    from pagoda.service.engine.core.speculation import SpecStats, StepRates

    assert propose_ngram([1, 9, 3, 7, 1, 2, 3], 2, 3, 3) == []  # "1 9 3" is not "1 2 3"
    assert propose_ngram([1, 2, 3, 7, 8, 1, 2, 3], 2, 3, 3) == [7, 8]
    stats = SpecStats()
    stats.count(3, 1)
    stats.count(2, 2)
    stats.count(4, 0)
    assert stats.accepted_per_position == [2, 1, 0, 0]
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 9, 3)
    rates = StepRates()
    rates.record(4, drafted=True, tokens=10, seconds=0.002)  # 5,000 tok/s
    rates.record(4, drafted=True, tokens=20, seconds=0.002)  # 10,000: the average moves a fifth of the way
    assert rates.rate(4, True) == pytest.approx(6_000)
    rates.record(4, drafted=False, tokens=4, seconds=0.0)  # a step not timed is not counted
    assert rates.rate(4, False) is None
