"""fp8_gemv, the W8A16 GEMV for 1-8 rows: the Triton kernel against `reference.fp8_matmul_w8a16`.

Run under TRITON_INTERPRET=1 (tests/test_kernels_interpret.py does) or on a GPU. The kernel differs
from the float32 reference only in the order of the float32 sums, so float32 outputs agree to 1e-5
and 16-bit outputs to one rounding step. With `silu_mul` it must equal `activation.silu_and_mul`
followed by the plain kernel to the bit.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from pagoda.kernels import reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA GPU", allow_module_level=True)

from pagoda.kernels.activation import silu_and_mul  # noqa: E402
from pagoda.kernels.fp8_gemm import GemvConfig, fp8_gemv  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
# Small tiles so the K loop runs several times and the masks cut: one warp, so a thread loads 8
# elements (4 for float32) of a 256-element chunk, the layout the GPU runs; and a tile of 1-element loads.
WIDE = GemvConfig(block_n=8, block_k=256, num_warps=1, num_stages=2)
NARROW = GemvConfig(block_n=4, block_k=32, num_warps=1, num_stages=1)


def fp8_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = reference.quantize_fp8_rows(torch.randn(n, k, device=DEVICE) * 0.05)
    return q, scale.view(-1)


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_gemv_matches_reference(dtype: torch.dtype, rows: int, split_k: int) -> None:
    torch.manual_seed(rows)
    n, k = 20, 600  # neither a multiple of the tile: 20 = 2 * 8 + 4 columns, 600 = 2 * 256 + 88
    weight, scale = fp8_weight(n, k)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    out = fp8_gemv(x, weight, scale, config=replace(WIDE, split_k=split_k))
    assert out.shape == (rows, n) and out.dtype == dtype
    expected = reference.fp8_matmul_w8a16(x, weight, scale)
    torch.testing.assert_close(out, expected, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "rows_n_k_split", [(2, 16, 512, 1), (5, 37, 100, 3), (4, 8, 70, 8), (1, 3, 1, 1)], ids=str
)
def test_fp8_gemv_tiles(dtype: torch.dtype, rows_n_k_split: tuple[int, int, int, int]) -> None:
    # Whole tiles (no masks), 1-element loads with K split unevenly, more splits than K chunks, K = 1.
    rows, n, k, split_k = rows_n_k_split
    torch.manual_seed(n)
    weight, scale = fp8_weight(n, k)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    cfg = replace(WIDE if k % WIDE.block_k == 0 else NARROW, split_k=split_k)
    out = fp8_gemv(x, weight, scale, config=cfg)
    expected = reference.fp8_matmul_w8a16(x, weight, scale)
    torch.testing.assert_close(out, expected, rtol=TOL[dtype], atol=TOL[dtype])


def test_fp8_gemv_default_config_and_row_scale_view() -> None:
    weight, scale = fp8_weight(48, 1024)
    x = torch.randn(2, 1024, device=DEVICE)
    out = fp8_gemv(x, weight, scale.view(1, -1))  # Fp8Linear keeps its scales as [1, N]
    torch.testing.assert_close(out, reference.fp8_matmul_w8a16(x, weight, scale), rtol=1e-5, atol=1e-5)


def test_fp8_gemv_upcasts_every_e4m3_code_exactly() -> None:
    codes = torch.arange(256, dtype=torch.int32, device=DEVICE)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # the finite ones (the interpreter has no NaN)
    weight = codes.view(torch.float8_e4m3fn).view(-1, 1)
    scale = torch.ones(len(codes), device=DEVICE)
    out = fp8_gemv(torch.ones(1, 1, device=DEVICE), weight, scale, config=WIDE)
    torch.testing.assert_close(out, weight.float().view(1, -1), rtol=0, atol=0)


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_gemv_silu_mul_is_the_unfused_path(dtype: torch.dtype, rows: int, split_k: int) -> None:
    torch.manual_seed(7)
    n, k = 24, 300
    weight, scale = fp8_weight(n, k)
    gate_up = (torch.randn(rows, 2 * k, device=DEVICE) * 3).to(dtype)
    cfg = replace(WIDE, split_k=split_k)
    fused = fp8_gemv(gate_up, weight, scale, config=cfg, silu_mul=True)
    unfused = fp8_gemv(silu_and_mul(gate_up), weight, scale, config=cfg)
    assert fused.shape == (rows, n) and fused.dtype == dtype
    assert torch.equal(fused, unfused), f"max diff {(fused.float() - unfused.float()).abs().max()}"
    if INTERPRET and dtype == torch.bfloat16:
        return  # the interpreter's bfloat16 cast truncates: toward zero, PyTorch to the nearest
    # PyTorch's SiLU may round a product's input a step apart, so a little looser than one rounding.
    expected = reference.fp8_matmul_w8a16(reference.silu_and_mul(gate_up), weight, scale)
    torch.testing.assert_close(fused, expected, rtol=2 * TOL[dtype], atol=2 * TOL[dtype])


def test_fp8_gemv_no_rows() -> None:
    weight, scale = fp8_weight(16, 64)
    assert fp8_gemv(torch.randn(0, 64, device=DEVICE), weight, scale).shape == (0, 16)


def test_fp8_gemv_refuses_bad_input() -> None:
    weight, scale = fp8_weight(16, 64)
    with pytest.raises(ValueError, match="at most 8 rows"):
        fp8_gemv(torch.randn(9, 64, device=DEVICE), weight, scale)
    with pytest.raises(ValueError, match="x dtype"):
        fp8_gemv(torch.zeros(2, 64, dtype=torch.int32, device=DEVICE), weight, scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemv(torch.randn(2, 64, device=DEVICE), weight.float(), scale)
    with pytest.raises(ValueError, match="weight \\[N, K\\]"):
        fp8_gemv(torch.randn(2, 32, device=DEVICE), weight, scale)
    with pytest.raises(ValueError, match="gate \\| up"):
        fp8_gemv(torch.randn(2, 64, device=DEVICE), weight, scale, silu_mul=True)
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_gemv(torch.randn(2, 64, device=DEVICE), weight, scale[:8])
    with pytest.raises(ValueError, match="contiguous in K"):
        fp8_gemv(torch.randn(64, 2, device=DEVICE).t(), weight, scale)
    with pytest.raises(ValueError, match="power of two"):
        fp8_gemv(torch.randn(2, 64, device=DEVICE), weight, scale, config=GemvConfig(block_n=6))
