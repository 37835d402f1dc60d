"""The engine against Hugging Face transformers, token for token, on random-weight checkpoints."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.llm_engine import LLMEngine
from pagoda.service.llm import LLM
from pagoda.service.sampling_params import SamplingParams

NEW_TOKENS = 32


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("ckpt_name", ["llama_ckpt", "qwen2_ckpt", "tied_llama_ckpt", "sharded_llama_ckpt"])
def test_greedy_matches_transformers(ckpt_name: str, request: pytest.FixtureRequest, hf_greedy: Any) -> None:
    from transformers import AutoModelForCausalLM

    ckpt: Path = request.getfixturevalue(ckpt_name)
    prompts = random_prompts([1, 7, 16, 17, 45, 100])
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    expected = hf_greedy(model, prompts, NEW_TOKENS)
    llm = LLM(str(ckpt), dtype="float32", max_num_batched_tokens=64, kv_cache_memory_bytes=8 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)  # both stop at EOS, keeping it
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("is_async", [False, True], ids=["in-turn", "async"])
def test_batch_invariance_under_preemption_and_chunking(llama_ckpt: Path, is_async: bool) -> None:
    """Each request's greedy output is the same alone as in a batch of 40 that arrive over time with
    a KV cache too small for all of them (preemption) and a small token budget (chunked prefill),
    with steps in turn and with async scheduling (tokens read a step late, placeholders preempted)."""
    rng = random.Random(7)
    lengths = [rng.randrange(1, 120) for _ in range(40)]
    prompts = random_prompts(lengths, seed=3)
    max_tokens = [rng.randrange(4, 24) for _ in prompts]

    alone_engine = LLMEngine(
        EngineConfig(model=str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20)
    )
    alone = []
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        alone_engine.add_request(
            f"a{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )
        while alone_engine.has_unfinished:
            for out in alone_engine.step():
                if out.finished:
                    alone.append(out.outputs[0].token_ids)

    # 40 blocks of 16 tokens: far less than 40 requests need at once.
    config = EngineConfig(
        model=str(llama_ckpt),
        dtype="float32",
        max_num_batched_tokens=48,
        max_mixed_prefill_tokens=24 if is_async else 0,  # one run with prompts held to 24 beside decodes
        max_num_seqs=64,
        kv_cache_memory_bytes=40 * alone_engine.runner.kv.bytes_per_block,
        async_scheduling=is_async,
    )
    engine = LLMEngine(config)
    results: dict[str, list[int]] = {}
    pending = list(enumerate(zip(prompts, max_tokens, strict=True)))
    while pending or engine.has_unfinished:
        for _ in range(3):  # three arrivals per step
            if pending:
                i, (prompt, n) = pending.pop(0)
                engine.add_request(
                    f"b{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                )
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    assert engine.scheduler.num_preemptions > 0
    assert [results[f"b{i}"] for i in range(len(prompts))] == alone
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prefix_cache_computes_only_new_tokens(llama_ckpt: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20))
    shared = random_prompts([64], seed=11)[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(rid: str, prompt: list[int]) -> tuple[list[int], int]:
        before = engine.computed_tokens_total
        engine.add_request(rid, prompt, params)
        while engine.has_unfinished:
            outs = engine.step()
        return outs[-1].outputs[0].token_ids, engine.computed_tokens_total - before

    run("first", [*shared, 5, 6, 7])
    hits_before = engine.block_manager.prefix_hits_tokens
    second_prompt = [*shared, 9, 10, 11, 12]
    tokens, computed = run("second", second_prompt)
    # 64 shared tokens = 4 full blocks come from the cache; only the 4 new prompt tokens and the
    # decode steps (one token each after the first) are computed.
    assert engine.block_manager.prefix_hits_tokens - hits_before == 64
    assert computed == len(second_prompt) - 64 + 7
    fresh = LLMEngine(
        EngineConfig(
            model=str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20, enable_prefix_caching=False
        )
    )
    fresh.add_request("x", second_prompt, params)
    while fresh.has_unfinished:
        outs = fresh.step()
    assert outs[0].outputs[0].token_ids == tokens


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_params_refused_before_scheduling(llama_ckpt: Path, fields: dict[str, float], param: str) -> None:
    """Refused when the parameters are built (as vLLM's are), so no engine ever holds such a request."""
    from pagoda.service.errors import InvalidRequestError

    engine = LLMEngine(EngineConfig(model=str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=4 << 20))
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", [5, 6, 7], SamplingParams(**fields))  # type: ignore[arg-type]
    assert info.value.param == param and param in str(info.value)
    assert not engine.scheduler.has_unfinished and not engine.has_unfinished


def test_prompt_over_context_refused_with_numbers(llama_ckpt: Path) -> None:
    from pagoda.service.errors import InvalidRequestError

    engine = LLMEngine(
        EngineConfig(model=str(llama_ckpt), dtype="float32", max_model_len=64, kv_cache_memory_bytes=4 << 20)
    )
    with pytest.raises(
        InvalidRequestError, match=r"maximum context length is 64 tokens.*prompt has 80 tokens"
    ):
        engine.add_request("long", list(range(3, 83)), SamplingParams(max_tokens=1))
    assert not engine.scheduler.has_unfinished


def test_prompt_logprobs_match_transformers_across_chunks(llama_ckpt: Path) -> None:
    """Scored in chunks of 7 (the scheduler's bound on scored positions a step, below the step's 16),
    with a cached copy of the prompt already in the prefix cache (which such requests must not use),
    and with n = 2 sharing the prompt."""
    from transformers import AutoModelForCausalLM

    prompt = random_prompts([45], seed=5)[0]
    engine = LLMEngine(
        EngineConfig(
            model=str(llama_ckpt), dtype="float32", max_num_batched_tokens=16, kv_cache_memory_bytes=8 << 20
        )
    )
    # The scoring bound (PROMPT_SCORE_TOKENS, 512) made small: 7 prompt positions a step, not 16.
    engine.scheduler.max_prompt_score_tokens = 7
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, n=2, prompt_logprobs=3)
    for rid, p in (("warm", SamplingParams(max_tokens=1)), ("scored", params)):
        engine.add_request(rid, prompt, p)
        steps = 0
        while engine.has_unfinished:
            outs = engine.step()
            steps += 1
    assert steps >= -(-(len(prompt) - 1) // 7)  # the 44 scored positions took 7 steps at least
    scored = outs[-1].prompt_logprobs
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None

    model = AutoModelForCausalLM.from_pretrained(llama_ckpt, dtype=torch.float32).eval()
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1], dim=-1)
    expected = logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    got = torch.tensor([lp.logprob for lp in scored[1:] if lp is not None])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for lp, row in zip(scored[1:], logprobs, strict=True):
        assert lp is not None and [t.token_id for t in lp.top] == row.topk(3).indices.tolist()
        # vLLM's rank: 1 + the tokens strictly likelier (bounds for float noise near a tie; not itself).
        t = lp.token_id
        likelier = (row > row[t] + 1e-4).sum().item(), (row > row[t] - 1e-4).sum().item() - 1
        assert lp.rank is not None and likelier[0] + 1 <= lp.rank <= likelier[1] + 1
    assert sorted(lp.rank for lp in scored[1:] if lp is not None and lp.rank is not None)[-1] > 3
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_llm_reset_prefix_cache_makes_a_repeated_prompt_compute_in_full(llama_ckpt: Path) -> None:
    """`LLM.reset_prefix_cache()`: the same prompt again takes its full blocks from the cache, and
    after a reset computes them all (what `bench offline` does before each timed run)."""
    llm = LLM(model=str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20)
    prompt = random_prompts([40], seed=12)[0]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    bm = llm.engine.block_manager
    first = llm.generate([prompt], params)[0].outputs[0].token_ids
    hits = bm.prefix_hits_tokens
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == first
    assert bm.prefix_hits_tokens - hits == 32  # two full 16-token blocks
    assert llm.reset_prefix_cache()
    hits = bm.prefix_hits_tokens
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == first
    assert bm.prefix_hits_tokens == hits
    llm.shutdown()
