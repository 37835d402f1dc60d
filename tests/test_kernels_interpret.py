"""Runs each Triton kernel check in `tests/kernels/` under the Triton interpreter on the CPU.

TRITON_INTERPRET is read when a kernel is decorated, so the checks run in a fresh interpreter each:
whatever this pytest process has imported already (torch, triton, the kernel modules) cannot leak
in. On a GPU machine the same files run directly: `pytest tests/kernels/check_*.py`.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "tests" / "kernels"
# All check files in one interpreter: they take ~90 s together on the 2-core machine, and each extra
# process paid ~8 s to import torch and triton (three shards of the paged-attention file and the small
# kernels, once needed when paged attention alone took 3 min, cost ~25 s of CPU).
CHECKS = ["paged_attention", "small_kernels", "fp8_kernels", "lora", "cudnn_attention"]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_every_check_file_is_run() -> None:
    assert sorted(p.stem.removeprefix("check_") for p in KERNELS.glob("check_*.py")) == sorted(CHECKS)


def test_kernels_match_their_references_in_interpreter() -> None:
    paths = [str(KERNELS / f"check_{name}.py") for name in CHECKS]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PAGODA_KERNELS": "triton", "PYTHONSAFEPATH": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *paths],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"kernel checks failed:\n{proc.stdout[-12000:]}\n{proc.stderr[-4000:]}"
    summary = proc.stdout.splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "deselected" not in summary, summary
