"""`python -m pagoda.bench.kernels` parses its arguments and refuses a machine without a GPU; its
tables and sweeps run on the GPU machine only (the kernels they time are checked in tests/kernels/)."""

from __future__ import annotations

import pytest
import torch

from pagoda.bench import kernels as bench


def test_help_lists_the_sweeps(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "--sweep-only" in out and "fp8" in out
    with pytest.raises(SystemExit):
        bench.main(["--sweep", "tiles"])  # not a sweep


def test_needs_a_gpu(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--sweep", "fp8", "--sweep-only"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
