"""Sampling and stopping through the engine's public API, on a tiny random-weight Llama."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.llm_engine import LLMEngine
from pagoda.service.outputs import RequestOutput
from pagoda.service.sampling_params import SamplingParams

PROMPT = [101, 2002, 3003, 4004, 5005, 6006, 7007]


@pytest.fixture(scope="module", params=[False, True], ids=["in-turn", "async"])
def engine(llama_ckpt: Path, request: pytest.FixtureRequest) -> LLMEngine:
    """Each test runs with steps in turn and with async scheduling (the CPU runs the same code)."""
    config = EngineConfig(
        model=str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20, async_scheduling=request.param
    )
    return LLMEngine(config)


def run(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, list[RequestOutput]]:
    """Submit all, step to the end; every streamed output per request."""
    streams: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished:
        for out in engine.step():
            streams[out.request_id].append(out)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # nothing leaked
    return streams


def final(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> RequestOutput:
    return run(engine, {"one": (prompt, params)})["one"][-1]


def greedy(max_tokens: int = 24, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)  # type: ignore[arg-type]


def test_seed_gives_same_output_whatever_the_batch(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = final(engine, PROMPT, params).outputs[0].token_ids
    others = {f"o{i}": ([7 + i, 8 + i, 9], SamplingParams(temperature=1.0, max_tokens=20)) for i in range(5)}
    batch = run(engine, {"seeded": (PROMPT, params), **others})
    assert batch["seeded"][-1].outputs[0].token_ids == alone
    other_seed = final(
        engine, PROMPT, SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    )
    assert other_seed.outputs[0].token_ids != alone


def test_top_k_one_is_greedy(engine: LLMEngine) -> None:
    sampled = final(engine, PROMPT, SamplingParams(temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True))
    assert sampled.outputs[0].token_ids == final(engine, PROMPT, greedy(16)).outputs[0].token_ids


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(engine: LLMEngine) -> None:
    reference = final(engine, PROMPT, greedy(32)).outputs[0]
    tokens = reference.token_ids
    tokenizer = engine.tokenizer
    # A stop string that starts inside token 5's text and ends inside token 7's.
    before = tokenizer.decode(tokens[:5])
    through = tokenizer.decode(tokens[:8])
    assert len(through) - len(before) >= 3, "need some text to cut"
    stop = through[len(before) + 1 : len(through) - 1]
    cut = reference.text.find(stop)
    outs = run(engine, {"s": (PROMPT, greedy(32, stop=[stop]))})["s"]
    last = outs[-1].outputs[0]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert last.text == reference.text[:cut]
    shown = list(itertools.accumulate(o.outputs[0].text_delta for o in outs))  # as a stream shows it
    assert shown[-1] == last.text and all(last.text.startswith(s) for s in shown)  # none of it cut later


def test_stop_token_ids_and_min_tokens(engine: LLMEngine) -> None:
    tokens = final(engine, PROMPT, greedy(16)).outputs[0].token_ids
    stopped = final(engine, PROMPT, greedy(16, stop_token_ids=[tokens[4]])).outputs[0]
    assert stopped.token_ids == tokens[: tokens.index(tokens[4]) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == tokens[4]
    # While min_tokens is not reached, the stop token cannot be sampled at all.
    held = final(engine, PROMPT, greedy(16, stop_token_ids=[tokens[0]], min_tokens=3)).outputs[0]
    assert tokens[0] not in held.token_ids[:3] and len(held.token_ids) >= 3


def test_max_tokens_finishes_with_length(engine: LLMEngine) -> None:
    out = final(engine, PROMPT, greedy(5)).outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_logprobs_with_top_alternatives(engine: LLMEngine) -> None:
    out = final(engine, PROMPT, greedy(8, logprobs=3)).outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 8
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token and len(lp.top) == 3
        assert lp.top[0].token_id == token and lp.top[0].logprob == pytest.approx(lp.logprob)
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
        assert lp.logprob <= 0.0


def test_n_completions_share_the_prompt(engine: LLMEngine) -> None:
    greedy_tokens = final(engine, PROMPT, greedy(12)).outputs[0].token_ids
    both = final(engine, PROMPT, greedy(12, n=2))
    assert [o.token_ids for o in both.outputs] == [greedy_tokens, greedy_tokens]
    sampled = final(
        engine, PROMPT, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    )
    assert [o.index for o in sampled.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in sampled.outputs}) == 3


def test_penalties_reduce_repetition(engine: LLMEngine) -> None:
    plain = final(engine, PROMPT, greedy(48)).outputs[0].token_ids
    penalized = (
        final(engine, PROMPT, greedy(48, frequency_penalty=2.0, presence_penalty=1.0)).outputs[0].token_ids
    )
    repeated = final(engine, PROMPT, greedy(48, repetition_penalty=3.0)).outputs[0].token_ids
    assert len(set(plain)) < 48, "the random model should repeat itself without penalties"
    assert len(set(penalized)) > len(set(plain))
    assert len(set(repeated)) > len(set(plain))


def test_stream_deltas_add_up_to_the_text(engine: LLMEngine) -> None:
    outs = run(engine, {"d": (PROMPT, greedy(40))})["d"]
    last = outs[-1].outputs[0]
    assert "".join(o.outputs[0].text_delta for o in outs) == last.text
    assert sum(len(o.outputs[0].token_ids_delta) for o in outs) == 40
    assert last.text == engine.tokenizer.decode(last.token_ids)


def test_abort_frees_blocks_at_once(engine: LLMEngine) -> None:
    engine.add_request("gone", PROMPT * 5, greedy(100))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    final = engine.abort("gone")
    assert final is not None and final.finished
    assert final.outputs[0].finish_reason == "abort" and len(final.outputs[0].token_ids) >= 1
    assert engine.abort("gone") is None  # idempotent
    assert not engine.has_unfinished
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_context_past_the_models_positions_is_refused_at_start(llama_ckpt: Path) -> None:
    """The tiny model has 2048 positions: a longer --max-model-len would fail the first long prompt."""
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLMEngine(EngineConfig(model=str(llama_ckpt), dtype="float32", max_model_len=4096))
