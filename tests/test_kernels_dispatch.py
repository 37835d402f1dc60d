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


@pytest.mark.parametrize(("capability", "expected"), [((8, 0), False), ((8, 9), True), ((9, 0), True)])
def test_fp8_attention_widens_by_ptx_only_where_the_gpu_converts(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], expected: bool
) -> None:
    """`cvt.rn.f16x2.e4m3x2` needs compute capability 8.9+: elsewhere the fp8 cache's tiles are cast
    (a CPU device stands for the sm_90 compile check)."""
    from pagoda.kernels import attention

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    attention._has_fp8_conversion.cache_clear()  # it asks once per device
    assert attention._has_fp8_conversion(torch.device("cuda", 0)) is expected
    attention._has_fp8_conversion.cache_clear()
    assert attention._has_fp8_conversion(torch.device("cpu"))
    with pytest.raises(ValueError, match="fp8_widen"):
        attention.DecodeConfig(fp8_widen="bytes")  # type: ignore[arg-type]


def test_the_cpu_paged_attention_writes_out_and_holds_callers_to_decode_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the reference path `out` is written and returned, and `decode_rows=False` with a sequence of one
    query token is refused: the GPU path would skip that row's kernel and leave it unwritten."""
    monkeypatch.delenv("PAGODA_KERNELS", raising=False)
    torch.manual_seed(0)
    cache = torch.randn(4, 4, 1, 8)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    q = torch.randn(5, 2, 8)
    prompts = (tables, torch.tensor([3, 2], dtype=torch.int32), torch.tensor([0, 3, 5], dtype=torch.int32))
    want = reference.paged_attention(q, cache, cache, *prompts, 0.5, 3, 3)
    out = torch.full_like(q, float("nan"))
    assert kernels.paged_attention(q, cache, cache, *prompts, 0.5, 3, 3, decode_rows=False, out=out) is out
    torch.testing.assert_close(out, want)
    decode = (tables, torch.tensor([3, 6], dtype=torch.int32), torch.tensor([0, 3, 4], dtype=torch.int32))
    assert kernels.paged_attention(q[:4], cache, cache, *decode, 0.5, 3, 6).shape == (4, 2, 8)
    with pytest.raises(ValueError, match="single query token"):
        kernels.paged_attention(q[:4], cache, cache, *decode, 0.5, 3, 6, decode_rows=False)
