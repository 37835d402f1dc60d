"""`pagoda.kernels` picks the reference or the Triton kernel by device and PAGODA_KERNELS."""

from __future__ import annotations

import pytest
import torch

import pagoda.kernels as kernels
from pagoda.kernels import reference


def test_cpu_tensors_use_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGODA_KERNELS", raising=False)
    x = torch.randn(3, 8)
    assert not kernels.use_triton(x)
    torch.testing.assert_close(kernels.silu_and_mul(x), reference.silu_and_mul(x))


@pytest.mark.parametrize(
    ("mode", "expected"), [("reference", False), ("triton", True), ("auto", False), ("", False)]
)
def test_env_forces_the_choice(monkeypatch: pytest.MonkeyPatch, mode: str, expected: bool) -> None:
    monkeypatch.setenv("PAGODA_KERNELS", mode)
    assert kernels.use_triton(torch.zeros(1)) is expected


def test_bad_env_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_KERNELS", "cuda")
    with pytest.raises(ValueError, match="PAGODA_KERNELS"):
        kernels.use_triton(torch.zeros(1))
