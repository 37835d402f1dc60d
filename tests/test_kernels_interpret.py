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
# Each check file in shards of about a minute (tests/pytest_plugins/shard.py: every N-th test), so that
# `pytest -n 2` runs them side by side: paged attention alone took 3 min, the small kernels 1.5.
SHARDS = {"paged_attention": 2, "small_kernels": 1, "fp8_kernels": 1}

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def test_every_check_file_is_run() -> None:
    assert sorted(p.stem.removeprefix("check_") for p in KERNELS.glob("check_*.py")) == sorted(SHARDS)


@pytest.mark.parametrize(
    ("name", "shard"),
    [(name, f"{i}/{n}") for name, n in SHARDS.items() for i in range(n)],
    ids=[f"{name}-{i}of{n}" for name, n in SHARDS.items() for i in range(n)],
)
def test_kernel_matches_reference_in_interpreter(name: str, shard: str) -> None:
    path = KERNELS / f"check_{name}.py"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PAGODA_KERNELS": "triton", "PYTHONSAFEPATH": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "shard",
            "--shard",
            shard,
            str(path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (
        f"{path.name} --shard {shard} failed:\n{proc.stdout[-12000:]}\n{proc.stderr[-4000:]}"
    )
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]  # not all deselected or skipped
