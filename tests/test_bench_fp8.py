"""`python -m pagoda.bench.kernels_fp8` imports, parses its arguments and refuses a machine without a GPU;
its tables run on the GPU machine only (the Triton kernels it times are checked in tests/kernels/)."""

from __future__ import annotations

import pytest
import torch

from pagoda.bench import kernels_fp8 as bench_fp8


def test_help_and_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_fp8.main(["--help"])
    printed = capsys.readouterr().out
    assert exit_info.value.code == 0 and "--sweep" in printed and "--gemm-kernels" in printed
    assert "--fast-accum" in printed
    with pytest.raises(SystemExit):
        bench_fp8.main(["--rows", "many"])  # row counts are integers
    with pytest.raises(SystemExit):
        bench_fp8.main(["--columns", "3"])


def test_needs_a_gpu(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_fp8.main(["--quick", "--sweep"]) == 2
    assert bench_fp8.main(["--gemm-kernels", "--rows", "1", "256"]) == 2
    assert bench_fp8.main(["--fast-accum"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_step_table_marks_the_best_fp8_path() -> None:
    per_layer = {1: {m: us for m, us in zip(bench_fp8.METHODS, [100.0, 90.0, 60.0, 50.0, 40.0], strict=True)}}
    lines = bench_fp8.step_table(per_layer)
    assert lines[-1] == "| 1 | 3.20 | 2.88 | 1.92 | 1.60* | 1.28 |"  # per-tensor is a bound, never marked
