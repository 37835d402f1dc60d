"""The CUDA-graph step paths' padding, checked on the CPU: `StepGraphs(capture=False)` runs the same
padded forward over the same static buffers as a replay would, so an engine using it must give the
outputs of the plain eager engine. Requests arrive two per step, so most steps mix prefill chunks
with decodes (the mixed graphs), and the tail of the run is pure decode (the decode graphs)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.llm_engine import LLMEngine
from pagoda.service.engine.runner.cuda_graphs import StepGraphs, graph_batch_sizes, mixed_token_sizes
from pagoda.service.sampling_params import SamplingParams

Work = list[tuple[str, list[int], SamplingParams]]


def _workload() -> Work:
    rng = random.Random(11)
    work: Work = []
    for i in range(24):
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randrange(1, 100))]
        if i % 3 == 0:
            params = SamplingParams(
                temperature=0.9, top_p=0.9, seed=i, max_tokens=16, logprobs=1, ignore_eos=True
            )
        else:
            params = SamplingParams(
                temperature=0.0, max_tokens=rng.randrange(1, 24), logprobs=1, ignore_eos=True
            )
        work.append((f"r{i}", prompt, params))
    return work


def _run(engine: LLMEngine, work: Work) -> dict[str, tuple[list[int], list[float]]]:
    finals: dict[str, tuple[list[int], list[float]]] = {}
    pending = list(work)
    while pending or engine.has_unfinished:
        for _ in range(2):
            if pending:
                engine.add_request(*pending.pop(0))
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                finals[out.request_id] = (c.token_ids, [lp.logprob for lp in c.logprobs or []])
    return finals


class _Counting(StepGraphs):
    """Counts the steps each path serves, so the test knows both ran, and the LM heads each mixed step
    ran: the graph's own only, unless its rows overflow the graph's logit rows (a verify step's)."""

    decode_steps = mixed_steps = lm_heads = 0

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.mixed_lm_heads: list[int] = []
        self.in_shared_buffer: list[bool] = []  # whether a step's logits were the graphs' one buffer
        self.decode_rows: list[int] = []  # each decode-graph step's batch
        self.pure_decode_mixed = 0  # mixed-graph steps whose rows were all decodes
        real = self.model.compute_logits

        def counted(hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            self.lm_heads += 1
            return real(hidden, out)

        self.model.compute_logits = counted  # type: ignore[method-assign]

    def run(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.decode_steps += 1
        self.decode_rows.append(len(args[0]))
        logits = super().run(*args, **kwargs)
        self.in_shared_buffer.append(logits.data_ptr() == self.logits.data_ptr())
        return logits

    def run_mixed(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.mixed_steps += 1
        self.pure_decode_mixed += len(args[0]["input_ids"]) == len(args[0]["seq_lens"])
        before = self.lm_heads
        logits = super().run_mixed(*args, **kwargs)
        self.mixed_lm_heads.append(self.lm_heads - before)
        self.in_shared_buffer.append(logits.data_ptr() == self.logits.data_ptr())
        return logits


@pytest.mark.parametrize(
    ("is_async", "max_capture", "budget"),
    [(False, 1024, 160), (True, 1024, 160), (False, 8, 160), (False, 1024, 256)],
    ids=["in-turn", "async", "capture-8", "two-mixed-sizes"],
)
def test_padded_graph_steps_give_the_eager_outputs(
    llama_ckpt: Path, is_async: bool, max_capture: int, budget: int
) -> None:
    """`max_capture` 8: decode steps of 9-24 rows take the mixed graphs, which score more rows than the
    largest decode graph holds (the shared logits buffer must hold max_num_seqs rows). A budget of 160
    tokens leaves steps of 129-160 tokens to the eager path, between graph steps; at 256 every step fits
    one of the two mixed graphs."""
    config = EngineConfig(
        model=str(llama_ckpt), dtype="float32", async_scheduling=is_async, max_num_batched_tokens=budget,
        max_num_seqs=24, kv_cache_memory_bytes=8 << 20,
    )  # fmt: skip
    work = _workload()
    expected = _run(LLMEngine(config), work)

    engine = LLMEngine(config)
    runner = engine.runner.runner
    graphs = _Counting(
        runner.model, runner.device, config.max_num_seqs, config.max_num_batched_tokens,
        runner.max_model_len, config.block_size, capture=False, max_capture=max_capture,
    )  # fmt: skip
    runner.graphs = graphs
    eager_steps = 0
    eager = runner._forward_eager

    def counted_eager(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal eager_steps
        eager_steps += 1
        return eager(*args, **kwargs)

    runner._forward_eager = counted_eager  # type: ignore[method-assign]
    got = _run(engine, work)

    assert graphs.mixed_steps > 5 and graphs.decode_steps > 5
    # A pure decode step takes a decode graph whenever one holds it, the largest included (32 for 24
    # sequences: steps of 17-24 rows); past the capture limit it takes a mixed graph.
    sizes = graph_batch_sizes(config.max_num_seqs, max_capture)
    assert graphs.max_batch_size == sizes[-1]
    assert sizes[-2] < max(graphs.decode_rows) <= sizes[-1]
    assert (graphs.pure_decode_mixed > 0) == (max_capture == 8)
    # A step runs eagerly only past the mixed ladder's largest size (the smallest graph that holds it).
    assert (eager_steps > 0) == (budget > mixed_token_sizes(budget)[-1]), eager_steps
    assert set(graphs.mixed_lm_heads) == {1}  # no step here overflows the logit rows: no second LM head
    # Every graph wrote its logits into one buffer, each step's read before the next overwrote them.
    assert all(graphs.in_shared_buffer) and len(graphs.in_shared_buffer) > 10
    assert {rid: tokens for rid, (tokens, _) in got.items()} == {rid: t for rid, (t, _) in expected.items()}
    for rid, (_, logprobs) in expected.items():
        assert got[rid][1] == pytest.approx(logprobs, abs=1e-4)


def test_decode_sizes_stop_at_the_batch_and_the_capture_limit() -> None:
    # Up to the first size that holds max_num_seqs rows, so a full batch replays a decode graph.
    assert graph_batch_sizes(24) == [1, 2, 4, 8, 16, 32]
    assert graph_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(1024, 512)[-4:] == [240, 256, 384, 512]
    assert graph_batch_sizes(1024, 256)[-2:] == [240, 256]
    assert graph_batch_sizes(2048)[-2:] == [896, 1024]  # the default limit
    assert graph_batch_sizes(1024, 1024)[19:] == [256, 384, 512, 640, 768, 896, 1024]  # 128-row tiles
    assert graph_batch_sizes(600, 1024)[-2:] == [512, 640]
    assert graph_batch_sizes(640, 1024)[-2:] == [512, 640]
    assert graph_batch_sizes(257, 1024)[-2:] == [256, 384]
    assert graph_batch_sizes(1024, 700)[-2:] == [512, 640]  # never above the capture limit
    assert graph_batch_sizes(1, 1024) == [1]
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        EngineConfig(max_cudagraph_capture_size=0)
    with pytest.raises(ValueError, match="long_prefill_attention must be paged or cudnn, got 'flash'"):
        EngineConfig(long_prefill_attention="flash")  # type: ignore[arg-type]


def test_mixed_sizes_stop_at_the_step_budget() -> None:
    assert mixed_token_sizes(300) == [128, 256]
    assert mixed_token_sizes(8192)[-1] == 2048
    assert mixed_token_sizes(64) == []
    assert mixed_token_sizes(8192, limit=0) == []  # --cuda-graph-max-tokens 0: decode graphs only
    assert mixed_token_sizes(8192, limit=600) == [128, 256, 384, 512]
    with pytest.raises(ValueError, match="cuda_graph_max_tokens"):
        EngineConfig(cuda_graph_max_tokens=-1)


def test_the_shared_logits_buffer_is_in_the_lm_heads_dtype_with_a_row_per_sequence(llama_ckpt: Path) -> None:
    """bf16 logits take half a float32 buffer's memory (~0.25 MB a row at Llama-3's vocabulary), and the
    buffer holds max_num_seqs rows even where the decode graphs stop below it (a mixed graph's rows)."""
    config = EngineConfig(
        model=str(llama_ckpt), dtype="bfloat16", max_num_seqs=4, kv_cache_memory_bytes=8 << 20
    )
    runner = LLMEngine(config).runner.runner
    graphs = StepGraphs(
        runner.model,
        runner.device,
        4,
        160,
        runner.max_model_len,
        config.block_size,
        capture=False,
        max_capture=2,
    )
    assert graphs.logits.dtype == torch.bfloat16
    assert graphs.logits.shape == (4, runner.model.config.vocab_size)
