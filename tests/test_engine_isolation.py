"""A request that makes a step raise fails alone: the others in its batch get exactly the tokens they
would have got without it, and the engine goes on. The failure is injected by the named test double
`failing_executor.FailingExecutor` (tests/doubles), around the real model on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from failing_executor import EXECUTOR_CLASS, HOSTILE_SEED, InjectedFailure

from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.core import engine_core as core_module
from pagoda.service.engine.llm_engine import LLMEngine
from pagoda.service.outputs import RequestOutput
from pagoda.service.sampling_params import SamplingParams

# Every test here makes steps raise (tests/conftest.py fails other tests where one does).
pytestmark = pytest.mark.steps_may_fail

PROMPTS = {"a": [101, 2002, 3003, 4004], "b": [7, 8, 9, 10, 11, 12], "c": [5005, 6006]}


@pytest.fixture(params=[False, True], ids=["in-turn", "async"])
def engine(llama_ckpt: Path, request: pytest.FixtureRequest) -> LLMEngine:
    config = EngineConfig(
        model=str(llama_ckpt),
        dtype="float32",
        kv_cache_memory_bytes=8 << 20,
        async_scheduling=request.param,
        executor_class=EXECUTOR_CLASS,
    )
    return LLMEngine(config)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # the failed request's blocks came back too
    return finals


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, **kw)  # type: ignore[arg-type]


def test_a_failing_request_fails_alone(engine: LLMEngine) -> None:
    expected = run(engine, {rid: (p, greedy()) for rid, p in PROMPTS.items()})
    mixed = {rid: (p, greedy()) for rid, p in PROMPTS.items()}
    mixed["hostile"] = ([42, 43, 44], greedy(seed=HOSTILE_SEED, n=2))
    finals = run(engine, mixed)

    hostile = finals["hostile"]
    assert [c.finish_reason for c in hostile.outputs] == ["error", "error"]
    assert hostile.error is not None and "injected failure" in hostile.error
    for rid in PROMPTS:
        assert finals[rid].error is None
        assert finals[rid].outputs[0].token_ids == expected[rid].outputs[0].token_ids
    assert engine.core.failed_requests_total == 1
    # The engine goes on: the same requests again, still the same tokens.
    again = run(engine, {rid: (p, greedy()) for rid, p in PROMPTS.items()})
    assert {rid: o.outputs[0].token_ids for rid, o in again.items()} == {
        rid: o.outputs[0].token_ids for rid, o in expected.items()
    }


def test_a_request_that_joins_mid_decode_fails_without_disturbing_running_ones(engine: LLMEngine) -> None:
    expected = run(engine, {"a": (PROMPTS["a"], greedy())})["a"].outputs[0].token_ids
    engine.add_request("a", PROMPTS["a"], greedy())
    engine.step()  # a prefills and gets its first token
    engine.add_request("hostile", [42, 43], greedy(seed=HOSTILE_SEED))
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["hostile"].outputs[0].finish_reason == "error"
    assert finals["a"].outputs[0].token_ids == expected


def test_steps_where_everything_fails_alone_fail_the_engine(engine: LLMEngine) -> None:
    """A broken model side is not a request's fault: after a few steps in which every request failed
    even alone, the step raises (the server then fails health and the pod restarts)."""
    for i in range(core_module.MAX_FAILED_STEPS_IN_A_ROW - 1):
        engine.add_request(f"h{i}", [42, 43], greedy(seed=HOSTILE_SEED))
        assert engine.step()[0].outputs[0].finish_reason == "error"
    engine.add_request("last", [42, 43], greedy(seed=HOSTILE_SEED))
    with pytest.raises(InjectedFailure):
        engine.step()


def test_steps_where_several_requests_all_fail_alone_fail_the_engine(engine: LLMEngine) -> None:
    """A step counts as failed when every client request in it failed, counted by client (a request of
    n = 2 is two sequences of one client), each tried alone even after one fails."""
    for i in range(core_module.MAX_FAILED_STEPS_IN_A_ROW - 1):
        engine.add_request(f"h{i}", [42, 43], greedy(seed=HOSTILE_SEED, n=2))
        engine.add_request(f"g{i}", [44, 45], greedy(seed=HOSTILE_SEED))
        outs = engine.step()
        assert sorted(o.request_id for o in outs) == [f"g{i}", f"h{i}"]
        assert all(c.finish_reason == "error" for o in outs for c in o.outputs)
    engine.add_request("last", [42, 43], greedy(seed=HOSTILE_SEED))
    engine.add_request("last2", [44, 45], greedy(seed=HOSTILE_SEED))
    with pytest.raises(InjectedFailure):
        engine.step()


def test_a_good_step_starts_the_count_of_failed_steps_again(engine: LLMEngine) -> None:
    """Failed steps count only in a row: one step that runs ends the run."""
    for rounds in range(2):
        for i in range(core_module.MAX_FAILED_STEPS_IN_A_ROW - 1):
            engine.add_request(f"h{rounds}{i}", [42, 43], greedy(seed=HOSTILE_SEED))
            assert engine.step()[0].outputs[0].finish_reason == "error"
        engine.add_request(f"ok{rounds}", [5, 6], SamplingParams(temperature=0.0, max_tokens=1))
        finals = run(engine, {})
        assert finals[f"ok{rounds}"].outputs[0].finish_reason == "length"
    for i in range(core_module.MAX_FAILED_STEPS_IN_A_ROW - 1):  # and a whole run fails the engine again
        engine.add_request(f"again{i}", [42, 43], greedy(seed=HOSTILE_SEED))
        assert engine.step()[0].outputs[0].finish_reason == "error"
    engine.add_request("last", [42, 43], greedy(seed=HOSTILE_SEED))
    with pytest.raises(InjectedFailure):
        engine.step()


def test_another_model_side_is_named_explicitly_or_refused(llama_ckpt: Path) -> None:
    """`executor_class` is the only way to a stand-in for the model (no environment variable switches
    one on): a malformed or unknown name is refused with what was asked for."""
    from pagoda.service.engine.runner.executor import Executor, build_executor

    with pytest.raises(ValueError, match="module:Class"):
        EngineConfig(model=str(llama_ckpt), executor_class="failing_executor.FailingExecutor")
    for name in ("no_such_module:Executor", "failing_executor:NoSuchClass"):
        config = EngineConfig(model=str(llama_ckpt), dtype="float32", executor_class=name)
        with pytest.raises(ValueError, match=f"{name!r} cannot be imported"):
            build_executor(config, set())
    config = EngineConfig(model=str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20)
    executor = build_executor(config, set())
    try:
        assert type(executor) is Executor
    finally:
        executor.shutdown()
