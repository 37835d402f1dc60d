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
CHECKS = sorted((ROOT / "tests" / "kernels").glob("check_*.py"))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.parametrize("path", CHECKS, ids=[p.stem.removeprefix("check_") for p in CHECKS])
def test_kernel_matches_reference_in_interpreter(path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PAGODA_KERNELS": "triton", "PYTHONSAFEPATH": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout[-12000:]}\n{proc.stderr[-4000:]}"
