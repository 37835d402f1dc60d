"""The `pagoda` command: subcommands listed, and the operator's parts run without torch installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BLOCKER = """
import sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "triton", "transformers", "fastapi", "uvicorn", "grpc", "httpx"}:
            raise ImportError(f"{name} is not installed in the operator image")
        return None
sys.meta_path.insert(0, _Blocked())
"""


def pagoda(tmp_path: Path, *args: str, block_server_deps: bool = False) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONSAFEPATH="1")
    if block_server_deps:
        (tmp_path / "sitecustomize.py").write_text(BLOCKER)
        env["PYTHONPATH"] = str(tmp_path)
    exe = Path(sys.executable).parent / "pagoda"
    return subprocess.run([str(exe), *args], env=env, capture_output=True, text=True, timeout=120)


def test_help_lists_the_subcommands(tmp_path: Path) -> None:
    out = pagoda(tmp_path, "--help")
    assert out.returncode == 0, out.stderr
    for name in ("serve", "operator", "profile", "bench"):
        assert name in out.stdout


def test_operator_side_runs_without_torch(tmp_path: Path) -> None:
    """The operator image installs `.[operator]` only: no torch, triton, FastAPI or grpc."""
    assert pagoda(tmp_path, "--help", block_server_deps=True).returncode == 0
    assert pagoda(tmp_path, "operator", "--help", block_server_deps=True).returncode == 0
    profile = pagoda(
        tmp_path,
        "profile",
        "--model",
        "llama-3.1-8b",
        "--gpu",
        "NVIDIA-H100-80GB-HBM3",
        "--count",
        "8",
        "--output",
        "json",
        block_server_deps=True,
    )
    assert profile.returncode == 0, profile.stderr
    assert '"precision": "fp8"' in profile.stdout
    # The blocker really blocks: serving needs torch.
    serve = pagoda(tmp_path, "serve", "--model", "/nonexistent", block_server_deps=True)
    assert serve.returncode != 0 and "not installed in the operator image" in serve.stderr
