"""Async scheduling against steps in turn, on a tiny random-weight Llama on the CPU: the core queues
step N+1 before it reads step N's tokens, so every output must be the one the in-turn engine gives,
whatever stops, aborts, preemptions and mixed sampling settings happen while a step is in flight."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.core.engine_core import EngineCore
from pagoda.service.engine.core.request import PLACEHOLDER
from pagoda.service.engine.llm_engine import LLMEngine
from pagoda.service.engine.messages import STEP_SECONDS_BUCKETS
from pagoda.service.grammar import Grammar
from pagoda.service.sampling_params import SamplingParams

GRAMMARS = [
    Grammar.json_schema({"type": "array", "items": {"type": "integer"}, "maxItems": 3}),
    Grammar.regex("[a-z]{2,6}( [a-z]{2,6})*"),
    Grammar.choice(["red", "green", "blue"]),
]
Finals = dict[str, list[tuple[list[int], str | None, list[float]]]]


def _engine(ckpt: Path, is_async: bool, **kw: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", async_scheduling=is_async, **kw))  # type: ignore[arg-type]


def _workload(seed: int = 5) -> list[tuple[str, list[int], SamplingParams, str | None]]:
    """(id, prompt, params, id of a request to abort when this one arrives), arriving two per step."""
    rng = random.Random(seed)
    work: list[tuple[str, list[int], SamplingParams, str | None]] = []
    for i in range(36):
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randrange(1, 70))]
        kind = i % 6
        if kind == 0:
            params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 20), ignore_eos=True)
        elif kind == 1:  # seeded sampling with every filter, and log-probabilities
            params = SamplingParams(
                temperature=0.8, top_k=40, top_p=0.9, min_p=0.01, seed=i, max_tokens=12, logprobs=2,
                ignore_eos=True,
            )  # fmt: skip
        elif kind == 2:  # n > 1, seeded, with a stop token the random model will sometimes hit
            params = SamplingParams(
                temperature=1.0, seed=i, n=2, max_tokens=10, stop_token_ids=list(range(3, 1003))
            )
        elif kind == 3:  # min_tokens holds the stop tokens back; logit_bias
            params = SamplingParams(
                temperature=0.0, max_tokens=9, min_tokens=3, stop_token_ids=[17, 18], logit_bias={17: 50.0}
            )
        elif kind == 5:  # grammars, pipelined: each step's bitmasks wait for the step before's tokens
            grammar = GRAMMARS[(i // 6) % len(GRAMMARS)]
            params = SamplingParams(temperature=0.9, seed=i, n=1 + i % 2, max_tokens=16, grammar=grammar)
        else:  # penalties and prompt log-probabilities: the core runs steps in turn while these are in
            params = SamplingParams(
                temperature=0.0, max_tokens=6, presence_penalty=0.7, repetition_penalty=1.2,
                prompt_logprobs=1, ignore_eos=True,
            )  # fmt: skip
        abort = f"r{i - 3}" if i % 7 == 6 else None
        work.append((f"r{i}", prompt, params, abort))
    return work


def _run(engine: LLMEngine, work: list[tuple[str, list[int], SamplingParams, str | None]]) -> Finals:
    finals: Finals = {}
    pending = list(work)
    while pending or engine.has_unfinished:
        for _ in range(2):
            if pending:
                rid, prompt, params, abort = pending.pop(0)
                engine.add_request(rid, prompt, params)
                if abort is not None:
                    engine.abort(abort)
                    finals.setdefault(abort, [])
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = [
                    (c.token_ids, c.finish_reason, [lp.logprob for lp in c.logprobs or []])
                    for c in out.outputs
                ]
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # nothing leaked, in flight or not
    assert not engine.core.has_unfinished  # no step left queued once every request has ended
    return finals


@pytest.mark.parametrize("kv_blocks", [None, 24], ids=["roomy", "preempting"])
def test_async_gives_the_in_turn_outputs(llama_ckpt: Path, kv_blocks: int | None) -> None:
    work = _workload()
    in_turn = _engine(llama_ckpt, False, kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=64)
    expected = _run(in_turn, work)
    memory = 8 << 20 if kv_blocks is None else kv_blocks * in_turn.runner.kv.bytes_per_block
    engine = _engine(llama_ckpt, True, kv_cache_memory_bytes=memory, max_num_batched_tokens=64)
    got = _run(engine, work)
    assert engine.core.is_async
    if kv_blocks is not None:
        assert engine.scheduler.num_preemptions > 0
    # Aborted requests may end at different points (the abort lands between different steps); every
    # other request must match: tokens and finish reasons exactly, log-probabilities to float noise (the
    # batches differ, so the matrix products sum in another order).
    aborted = {abort for *_, abort in work if abort is not None}
    finished = {rid: v for rid, v in expected.items() if rid not in aborted}
    assert {rid: [c[:2] for c in got[rid]] for rid in finished} == {
        rid: [c[:2] for c in v] for rid, v in finished.items()
    }
    for rid, completions in finished.items():
        for (*_, want), (*_, have) in zip(completions, got[rid], strict=True):
            assert have == pytest.approx(want, abs=1e-4)
    assert any(reason == "stop" for outs in finished.values() for _, reason, _ in outs)


def test_tokens_arrive_a_step_late_and_requests_that_need_them_take_turns(llama_ckpt: Path) -> None:
    """The pipelining itself, through the public step(): a step returns the tokens of the step queued
    before it. A request whose sampling needs its last token on the host (penalties) makes the core
    run steps in turn, and once it is gone the core pipelines again."""
    engine = _engine(llama_ckpt, True, kv_cache_memory_bytes=8 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    assert engine.step() == []  # the prefill is queued; its token is read by the next step
    core = engine.core
    assert core._in_flight is not None and core._in_flight.sampling[0].token_ids[-1] == PLACEHOLDER
    assert [o.request_id for o in engine.step()] == ["a"]
    while engine.has_unfinished:
        engine.step()

    # Any penalty, either sign (repetition below 1 too), reads the tokens so far: in turn, each token in
    # the step that computed it.
    for i, penalty in enumerate(
        [{"presence_penalty": 0.5}, {"presence_penalty": -0.5}, {"frequency_penalty": -0.5},
         {"repetition_penalty": 0.8}]
    ):  # fmt: skip
        penalised = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, **penalty)  # type: ignore[arg-type]
        engine.add_request(f"p{i}", [5, 6, 7], penalised)
        assert [o.request_id for o in engine.step()] == [f"p{i}"], penalty
        while engine.has_unfinished:
            engine.step()
    engine.add_request("b", [5, 6, 7], params)
    assert engine.step() == []  # pipelined again
    while engine.has_unfinished:
        engine.step()

    # A grammar does not take turns: its first token comes a step after its prefill, as a free one's.
    constrained = SamplingParams(temperature=0.0, max_tokens=12, grammar=Grammar.regex("[a-z]{3}"))
    engine.add_request("g", [5, 6, 7], constrained)
    while not core._in_flight:
        assert engine.step() == []  # its grammar compiles, then its prefill is queued
    outs = engine.step()
    assert [o.request_id for o in outs] == ["g"] and core._in_flight is not None
    while engine.has_unfinished:
        outs += engine.step()
    # Each token advanced the grammar: three letters, then its end stopped the completion.
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and re.fullmatch("[a-z]{3}", final.text), final


def test_each_new_longest_step_past_the_threshold_is_logged(
    llama_ckpt: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What `--engine-stall-timeout` is chosen against (docs/processes.md): a step that is the longest so
    far and at least `LOG_STEP_OVER_S` long is logged, with its size; shorter or no longer ones are not."""
    import logging

    from pagoda.service.engine.core import engine_core as core

    engine = _engine(llama_ckpt, False, kv_cache_memory_bytes=8 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run(prompt: list[int]) -> None:
        engine.add_request(str(prompt[0]), prompt, params)
        while engine.has_unfinished:
            engine.step()

    monkeypatch.setattr(core, "LOG_STEP_OVER_S", 3600.0)
    with caplog.at_level(logging.INFO, logger=core.__name__):
        run([5, 6, 7])
        assert engine.core.longest_step_s > 0 and not caplog.records
        monkeypatch.setattr(core, "LOG_STEP_OVER_S", 0.0)
        engine.core.longest_step_s = 0.0
        run(list(range(10, 60)))
    logged = [float(r.getMessage().split(": ")[1].split(" s ")[0]) for r in caplog.records]
    # Each one at least as long as the one before (printed to the millisecond, two can print alike).
    assert logged and logged == sorted(logged)
    assert logged[-1] == pytest.approx(engine.core.longest_step_s, abs=0.006)
    assert "(1 sequences, 50 tokens)" in caplog.records[0].getMessage()  # the prefill comes first


@pytest.mark.parametrize("is_async", [False, True], ids=["in-turn", "async"])
def test_each_step_is_counted_once_in_its_kind(llama_ckpt: Path, is_async: bool) -> None:
    """`pagoda:step_seconds` by kind: one prompt of 3 tokens and 5 new ones is a mixed step (the
    prefill) and 4 decode steps, each counted once; async scheduling runs one decode step more (the one
    queued before the last token's stop is seen, whose token is dropped)."""
    engine = _engine(llama_ckpt, is_async, kv_cache_memory_bytes=8 << 20)
    engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    stats = engine.core.stats()
    assert {k: sum(v) for k, v in stats.step_bucket_counts.items()} == {"mixed": 1, "decode": 4 + is_async}
    # A bucket per bound and the last one past them all (Prometheus' +Inf)
    assert [len(v) for v in stats.step_bucket_counts.values()] == [len(STEP_SECONDS_BUCKETS) + 1] * 2
    assert (stats.prompt_tokens_total, stats.generation_tokens_total) == (3, 5)  # the extra step's: dropped
    assert stats.step_seconds_sum["decode"] > 0 and stats.step_seconds_sum["mixed"] > 0
    # No pause counter in-process (the core process starts one): the counters say none, not -1.
    assert stats.gc_collections_total == 0 and stats.gc_pause_seconds_total == 0.0


@pytest.mark.parametrize("is_async", [False, True], ids=["in-turn", "async"])
def test_a_grammar_that_fails_to_compile_fails_its_request_alone(llama_ckpt: Path, is_async: bool) -> None:
    """The core's own guard (the API process refuses such a grammar first): a grammar the compile
    thread refuses ends its request with the reason, and nothing else; the request beside it runs, and
    the core is left with nothing unfinished."""
    from pagoda.service.engine.messages import AddRequest

    core = _engine(llama_ckpt, is_async, kv_cache_memory_bytes=8 << 20).core
    bad = SamplingParams(max_tokens=4, grammar=Grammar("regex", "(unclosed"))
    core.add_request(AddRequest("bad", [5, 6, 7], bad, 0.0))
    core.add_request(AddRequest("good", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), 0.0))
    failures, tokens = [], []
    for _ in range(500):
        out = core.step()
        failures += out.failures
        tokens += [t.request_id for t in out.tokens]
        if not core.has_unfinished:
            break
    assert not core.has_unfinished and tokens == ["good"] * 4
    assert [(f.request_id, "failed to compile" in f.message) for f in failures] == [("bad", True)]
    assert core.failed_requests_total == 1


@pytest.mark.parametrize("is_async", [False, True], ids=["in-turn", "async"])
def test_the_core_ends_sequences_at_eos_and_at_the_context_and_counts_cached_tokens_once(
    llama_ckpt: Path, is_async: bool
) -> None:
    """EOS ends a sequence unless ignore_eos; the context length ends one with "length" at exactly
    max_model_len tokens; the first token of a request whose prompt was cached says how much was."""

    engine = _engine(llama_ckpt, is_async, kv_cache_memory_bytes=8 << 20, max_model_len=40, block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = list(range(10, 30))
    engine.add_request("first", prompt, greedy)
    first = [o for o in _drain(engine) if o.request_id == "first"][-1].outputs[0].token_ids
    core: EngineCore = engine.core
    at = next(i for i in range(1, len(first)) if first[i] not in first[:i])  # a token new at position `at`
    core.eos_token_ids = frozenset({first[at]})  # is now an end-of-sequence token
    engine.add_request("eos", prompt, SamplingParams(temperature=0.0, max_tokens=8))
    engine.add_request("ignored", prompt, greedy)
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
    finals = {o.request_id: o for o in _drain(engine) if o.finished}
    assert finals["eos"].outputs[0].token_ids == first[: at + 1]
    assert finals["eos"].outputs[0].finish_reason == "stop"
    assert finals["ignored"].outputs[0].token_ids == first
    assert len(finals["long"].outputs[0].token_ids) == 40 - len(prompt)
    assert finals["long"].outputs[0].finish_reason == "length"
    # 20 prompt tokens in blocks of 4: the first 4 blocks come from the cache, the last is computed
    assert [finals[r].metrics.num_cached_tokens for r in ("eos", "ignored", "long")] == [16, 16, 16]


def _drain(engine: LLMEngine) -> list:  # every output until nothing is left
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    return outputs


def test_aborting_one_sequence_of_a_request_frees_it_alone(llama_ckpt: Path) -> None:
    """What the API process does when one of n completions hits a stop string: that sequence ends, its
    blocks come back, the others run on."""
    engine = _engine(llama_ckpt, False, kv_cache_memory_bytes=8 << 20)
    engine.add_request(
        "n3", [5, 6, 7], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    )
    engine.step()
    engine.step()
    core = engine.core
    core.abort("n3", index=1)
    assert [s.status.name for s in core._requests["n3"]] == ["RUNNING", "FINISHED", "RUNNING"]
    _drain_core(core)
    bm = core.block_manager
    assert bm.num_free_blocks == bm.num_blocks and "n3" not in core._requests


def _drain_core(core: EngineCore) -> None:
    for _ in range(50):
        if not core.has_unfinished:
            return
        core.step()
    raise AssertionError("the core did not finish")


def test_aborting_the_last_request_drains_the_step_in_flight(llama_ckpt: Path) -> None:
    """With async scheduling, a step is queued behind the one completed; aborting the only request
    leaves nothing to wait on it, so the abort completes it then: the core is idle at once, with every
    block back (a later step() would have found it and done the same, later)."""
    engine = _engine(llama_ckpt, True, kv_cache_memory_bytes=8 << 20)
    engine.add_request("only", [5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    core = engine.core
    assert core._in_flight is not None
    core.abort("only")
    assert not core.has_unfinished and core._in_flight is None
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
