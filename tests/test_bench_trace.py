"""`python -m pagoda.bench.trace` on a small Chrome trace shaped like torch.profiler's: the GPU's
busy intervals merged across streams, each gap put down to the innermost host call when it began."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.bench import trace as bench_trace


def _event(cat: str, name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


TRACE = {
    "traceEvents": [
        _event("kernel", "gemm", 0, 100),
        _event("kernel", "attn", 50, 80, tid=2),  # overlaps gemm on another stream: busy 0-130
        _event("gpu_memcpy", "Memcpy HtoD", 132, 3),  # a 2 us gap: under the threshold
        _event("kernel", "norm", 185, 15),  # gap 135-185 (50 us)
        _event("kernel", "sample", 300, 10),  # gap 200-300 (100 us)
        _event("kernel", "tail", 320, 10),  # gap 310-320 (10 us): nothing on the host then
        {"ph": "i", "name": "marker", "ts": 5},  # not a complete event: ignored
        _event("cpu_op", "engine step", 100, 200),
        _event("cuda_runtime", "cudaStreamSynchronize", 130, 40),  # covers 135: innermost there
        _event("cpu_op", "aten::index_copy_", 195, 50),  # covers 200
        _event("user_annotation", "engine: step", 0, 400),
        _event("user_annotation", "runner: prepare inputs", 190, 60),  # the innermost phase at 200
    ]
}


def test_gaps_are_put_down_to_the_innermost_host_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = bench_trace.analyze(TRACE, min_gap_us=5)
    assert (report.start_us, report.span_us, report.busy_us) == (0, 330, 130 + 3 + 15 + 10 + 10)
    assert [(g.start_us, g.us, g.host, g.phase) for g in report.gaps] == [
        (135, 50, "cudaStreamSynchronize", "engine: step"),
        (200, 100, "aten::index_copy_", "runner: prepare inputs"),
        (310, 10, bench_trace.IDLE_HOST, "engine: step"),  # within a phase, between calls
    ]
    assert report.neighbours == {  # every gap, the 2 us one too, by the device ops on either side
        ("attn", "Memcpy HtoD"): (1, 2),
        ("Memcpy HtoD", "norm"): (1, 50),
        ("norm", "sample"): (1, 100),
        ("sample", "tail"): (1, 10),
    }
    assert report.by_size == {"1-5 us": (1, 2), "5-50 us": (1, 10), "50 us or more": (2, 150)}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    assert bench_trace.main([str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "GPU busy 0.17 ms (51%), idle 0.16 ms" in out
    assert (
        "| runner: prepare inputs / aten::index_copy_ | 1 | 0.100 | 100 |" in out
        and out.count(" us at ") == 2
    )
    assert "| norm | sample | 1 | 0.100 |" in out and "| 50 us or more | 2 | 0.150 |" in out


def test_a_trace_without_gpu_events_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": [_event("cpu_op", "aten::mm", 0, 10)]}))
    assert bench_trace.main([str(path)]) == 2
    assert "no GPU events" in capsys.readouterr().err


def test_without_phases_the_gap_is_put_down_to_the_call_alone() -> None:
    plain = {"traceEvents": [e for e in TRACE["traceEvents"] if e.get("cat") != "user_annotation"]}
    gaps = bench_trace.analyze(plain).gaps
    assert [(g.host, g.phase) for g in gaps][-1] == (bench_trace.IDLE_HOST, "")
