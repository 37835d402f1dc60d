"""`pagoda bench offline` on the CPU with a small checkpoint: the table it appends, and the prefill
profile's line (its GPU-busy part runs on the GPU machine only)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import torch

from pagoda.bench import offline as bench
from pagoda.service.model.loader import load_model
from pagoda.service.outputs import RequestMetrics, RequestOutput


def test_offline_table_and_prefill_profile(
    llama_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.md"
    args = ["offline", "--model", str(llama_ckpt), "--device", "cpu", "--dtype", "float32", "--peer", "none",
            "--num-prompts", "3", "--input-len", "12", "--output-len", "3", "--max-num-batched-tokens", "16",
            "--profile-prefill", "--busy-trace", str(tmp_path / "t.json"), "--output", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    printed = capsys.readouterr().out
    # The prefill's host calls, written beside the path --busy-trace names (no --busy-steps: no other).
    assert sorted(p.name for p in tmp_path.glob("t*")) == ["t.prefill.json"]
    events = json.loads((tmp_path / "t.prefill.json").read_text())["traceEvents"]
    assert any(e.get("name") == "aten::linear" for e in events)
    line = re.search(
        r"prefill of 3 x 12 tokens: (\d+) steps, ([\d.]+) ms .* projections at ([\d.]+) TFLOP/s", printed
    )
    assert line is not None, printed
    assert int(line[1]) >= 3  # 36 prompt tokens, 16 a step
    assert float(line[2]) > 0 and "GPU busy" not in printed
    rows = [r for r in out.read_text().splitlines() if r.startswith("| pagoda |")]
    assert [r.split("|")[2].strip() for r in rows] == ["1", "3"]
    # The batch's phases: its last first token within the run, then ms a step; not for the single stream.
    single, batch = ([c.strip() for c in r.split("|")] for r in rows)
    assert single[8:10] == ["", ""]
    assert 0 < float(batch[8]) <= float(batch[3]) and float(batch[9]) > 0
    command = re.search(r"Command: `(.*)`", out.read_text())
    assert command is not None and "--num-prompts 3 " in command[1]
    assert "--profile-prefill" in command[1].split() and "True" not in command[1].split()  # a flag, no value
    assert not command[1].startswith("PAGODA_PDL")  # the kernels' launch switch is on by default


def test_the_command_names_the_launch_switch_when_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda.kernels import pdl

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["offline", "--num-prompts", "2"])
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert bench._command(args).startswith("PAGODA_PDL=0 pagoda bench offline ")


def test_a_busy_figure_says_when_pdl_makes_it_overstate(monkeypatch: pytest.MonkeyPatch) -> None:
    """With programmatic dependent launch on the device, GPU-busy counts kernels waiting to start: the
    busy line says so and how to turn it off; without it (a CPU here), nothing is added."""
    from pagoda.kernels import pdl

    assert bench.busy_caveat(torch.device("cpu")) == ""
    monkeypatch.setattr(pdl, "flags", lambda t: {"PDL": True, "launch_pdl": True})  # as on a Hopper GPU
    assert "PAGODA_PDL=0" in bench.busy_caveat(torch.device("cpu"))


def test_repeat_times_the_largest_batch_again_on_the_same_engine(
    llama_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--repeat 3`: the batch of N requests runs three times (a row each) and the table gives their
    median; the single stream runs once."""
    out = tmp_path / "bench.md"
    args = ["offline", "--model", str(llama_ckpt), "--device", "cpu", "--dtype", "float32", "--peer", "none",
            "--num-prompts", "2", "--input-len", "6", "--output-len", "2", "--repeat", "3",
            "--output", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    table = out.read_text()
    rows = [r.split("|") for r in table.splitlines() if r.startswith("| pagoda")]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [
        ("pagoda", "1"), ("pagoda, run 1", "2"), ("pagoda, run 2", "2"), ("pagoda, run 3", "2"),
    ]  # fmt: skip
    rates = sorted(float(r[4]) for r in rows[1:])
    median = re.search(r"3 runs at 2 requests: median ([\d.]+) output tok/s, ([\d.]+)-([\d.]+)\.", table)
    assert median is not None, table
    assert [float(median[i]) for i in (2, 1, 3)] == pytest.approx(rates, abs=0.1)
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit):
            bench.main([*args[:-4], "--repeat", bad])
    assert "expected a count of at least 1" in capsys.readouterr().err


def test_the_null_executor_times_the_engines_host_work_alone(llama_ckpt: Path, tmp_path: Path) -> None:
    """`--executor-class ...NullExecutor`: the engine around no model (its host work per step); the
    table says so, and its command line names the stand-in."""
    out = tmp_path / "bench.md"
    null = "pagoda.service.engine.runner.null_executor:NullExecutor"
    args = ["offline", "--model", str(llama_ckpt), "--device", "cpu", "--peer", "none",
            "--num-prompts", "64", "--input-len", "16", "--output-len", "40", "--executor-class", null,
            "--output", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    table = out.read_text()
    assert "no model (null executor)" in table and f"--executor-class {null}" in table
    batch = next(r.split("|") for r in table.splitlines() if r.startswith("| pagoda | 64 "))
    assert float(batch[4]) > 0 and float(batch[9]) > 0  # output tok/s, host ms a decode step


def test_batch_phases_take_the_last_first_token_and_the_steps_after_it() -> None:
    def out(first: float | None) -> RequestOutput:
        return RequestOutput("r", [1], [], True, RequestMetrics(arrival_time=100.0, first_token_time=first))

    outs = [out(101.5), out(103.0), out(102.0)]
    # 11 output tokens: the last first token at 3 s, then 10 steps over the remaining 2 s.
    assert bench.batch_phases(outs, 100.0, 105.0, 11) == pytest.approx((3.0, 200.0))
    assert bench.batch_phases(outs, 100.0, 105.0, 1) == pytest.approx((3.0, None))
    with pytest.raises(ValueError, match="first token"):
        bench.batch_phases([*outs, out(None)], 100.0, 105.0, 11)


def test_projection_params_counts_the_projection_weights(llama_ckpt: Path) -> None:
    model, config = load_model(llama_ckpt, dtype=torch.float32)
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    counted = sum(p.numel() for n, p in model.named_parameters() if any(f"{k}.weight" in n for k in names))
    assert counted > 0 and bench.projection_params(config) == counted


def test_busy_trace_records_the_steady_steps(llama_ckpt: Path, tmp_path: Path) -> None:
    """`--busy-trace` writes a Chrome trace of the profiled decode steps, with the host's calls (on the
    CPU there is no GPU-busy figure, only the trace); with both scheduling modes, a file each."""
    trace = tmp_path / "steps.json"
    args = ["offline", "--model", str(llama_ckpt), "--device", "cpu", "--dtype", "float32", "--peer", "none",
            "--num-prompts", "2", "--input-len", "8", "--output-len", "2", "--async-scheduling", "both",
            "--busy-steps", "3", "--busy-trace", str(trace)]  # fmt: skip
    assert bench.main(args) == 0
    for mode in ("async", "in-turn"):
        events = json.loads((tmp_path / f"steps.{mode}.json").read_text())["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert any("aten::" in n for n in names), sorted(names)[:20]  # the model's ops, recorded on the host
        phases = {"engine: step", "core: schedule", "core: take tokens", "runner: forward", "runner: sample"}
        assert phases <= names, sorted(n for n in names if ":" in n and "::" not in n)
    assert not trace.exists()
    assert bench._trace_path("t.json", True, both_modes=False) == "t.json"
    assert bench._trace_path("trace", False, both_modes=True) == "trace.in-turn"


def test_phase_annotations_are_removed_afterwards(llama_ckpt: Path) -> None:
    """`_annotated_phases` wraps the engine's methods for the trace only: after it, they are the
    class's own again (no instance attribute left), and the engine still runs."""
    from pagoda.service.llm import LLM
    from pagoda.service.sampling_params import SamplingParams

    llm = LLM(model=str(llama_ckpt), device="cpu", dtype="float32")
    engine = llm.engine
    with bench._annotated_phases(engine):
        assert "step" in vars(engine) and "schedule" in vars(engine.core.scheduler)
    assert "step" not in vars(engine) and "schedule" not in vars(engine.core.scheduler)
    assert "prepare" not in vars(engine.runner.runner)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2
    llm.shutdown()


def test_device_work_leaves_out_the_annotated_ranges() -> None:
    """A `record_function` range has device time of its own on a GPU (the span of the kernels under
    it): the busy figure counts the kernels, copies and memsets only, not the range again."""
    from types import SimpleNamespace

    kernel = SimpleNamespace(key="_decode_kernel", self_device_time_total=700.0, is_user_annotation=False)
    memset = SimpleNamespace(key="Memset (Unknown)", self_device_time_total=1.0, is_user_annotation=False)
    phase = SimpleNamespace(key="runner: forward", self_device_time_total=750.0, is_user_annotation=True)
    host = SimpleNamespace(key="aten::mm", self_device_time_total=0.0, is_user_annotation=False)
    assert bench.device_work([kernel, phase, memset, host]) == [kernel, memset]


def test_long_chunk_tokens_moves_the_cudnn_threshold(
    llama_ckpt: Path, tmp_path: Path, cudnn_calls: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--long-chunk-tokens 8` (a benchmark knob): 12-token prompt chunks attend through cuDNN (the CPU's
    flash op, bf16), which the engine's 4096-token threshold leaves to the paged kernel; refused with
    the paged attention."""
    args = ["offline", "--model", str(llama_ckpt), "--device", "cpu", "--dtype", "bfloat16", "--peer", "none",
            "--num-prompts", "2", "--input-len", "12", "--output-len", "2",
            "--max-num-batched-tokens", "16"]  # fmt: skip
    assert bench.main(args) == 0 and cudnn_calls[0] == 0
    assert bench.main([*args, "--long-chunk-tokens", "8"]) == 0 and cudnn_calls[0] > 0
    with pytest.raises(SystemExit, match="only with --long-prefill-attention cudnn"):
        bench.main([*args, "--long-chunk-tokens", "8", "--long-prefill-attention", "paged"])


def test_whole_prompt_tokens_moves_the_own_rows_threshold(
    llama_ckpt: Path, cudnn_calls: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--whole-prompt-tokens 8` (a benchmark knob): 12-token whole prompts attend through cuDNN on the
    step's own K/V (`prompt_attention`), which the engine's 2048-token threshold leaves to the paged
    kernel; 0 switches it off; refused with the paged attention or below 0."""
    args = ["offline", "--model", str(llama_ckpt), "--device", "cpu", "--dtype", "bfloat16", "--peer", "none",
            "--num-prompts", "2", "--input-len", "12", "--output-len", "2",
            "--max-num-batched-tokens", "32"]  # fmt: skip
    assert bench.main(args) == 0 and cudnn_calls == [0, 0]
    assert bench.main([*args, "--whole-prompt-tokens", "0"]) == 0 and cudnn_calls == [0, 0]
    assert bench.main([*args, "--whole-prompt-tokens", "8"]) == 0 and cudnn_calls[1] > 0
    assert cudnn_calls[0] == cudnn_calls[1]  # whole prompts only: no chunk behind a prefix
    for bad in (
        ["--whole-prompt-tokens", "8", "--long-prefill-attention", "paged"],
        ["--whole-prompt-tokens", "-1"],
    ):
        with pytest.raises(SystemExit, match="only with --long-prefill-attention cudnn"):
            bench.main([*args, *bad])
