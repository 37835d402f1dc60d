"""`kernels.pdl.flags`: programmatic dependent launch only on a CUDA device with it switched on, and the
kernel's wait always set with the launch's early start (tests/test_kernels_compile.py checks the waits
in each kernel's sm_90 PTX)."""

from __future__ import annotations

import importlib

import pytest
import torch

from pagoda.kernels import pdl


def test_on_by_default_and_never_on_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGODA_PDL", raising=False)
    assert importlib.reload(pdl).ENABLED
    monkeypatch.setenv("PAGODA_PDL", "0")
    assert not importlib.reload(pdl).ENABLED
    monkeypatch.delenv("PAGODA_PDL")
    importlib.reload(pdl)
    # The interpreter and CPU tensors never take the early launch, switched on or not.
    assert pdl.flags(torch.zeros(1)) == {"PDL": False}


def test_on_a_hopper_gpu_the_wait_comes_with_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeCudaTensor:  # a stand-in for a CUDA tensor: no GPU here
        is_cuda = True
        device = torch.device("cuda", 0)

    capability = {0: (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability[index])
    pdl._supported.cache_clear()
    try:
        monkeypatch.setattr(pdl, "ENABLED", False)  # PAGODA_PDL=0
        assert pdl.flags(FakeCudaTensor()) == {"PDL": False}
        monkeypatch.setattr(pdl, "ENABLED", True)
        assert pdl.flags(FakeCudaTensor()) == {"PDL": True, "launch_pdl": True}
        pdl._supported.cache_clear()
        capability[0] = (8, 0)  # an A100: no griddepcontrol
        assert pdl.flags(FakeCudaTensor()) == {"PDL": False}
    finally:
        pdl._supported.cache_clear()
