"""quantize_fp8_rows, scale_product and the skinny W8A16 fp8 GEMM: the Triton kernels against `reference.py`.

Run under TRITON_INTERPRET=1 (tests/test_kernels_interpret.py does) or on a GPU. The quantization
must match to the bit (scales and fp8 codes); the GEMM differs from the float32 reference only in
the order of the float32 sums, so float32 outputs agree to 1e-5 and 16-bit outputs to one rounding
step.
"""

from __future__ import annotations

import os

import pytest
import torch

from pagoda.kernels import reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA GPU", allow_module_level=True)

from pagoda.kernels.fp8_gemm import Fp8GemmConfig, fp8_matmul_w8a16  # noqa: E402
from pagoda.kernels.quant import quantize_fp8_rows, scale_product  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GEMM_DTYPES = DTYPES[:2] if INTERPRET else DTYPES  # the interpreter's tl.dot has no bfloat16 (numpy)
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
# The interpreter runs a program at a time: small tiles exercise the K loop and the masks.
SMALL = Fp8GemmConfig(block_k=64, num_warps=1, num_stages=1)


def assert_same_quantization(x: torch.Tensor) -> None:
    q, scale = quantize_fp8_rows(x)
    q_ref, scale_ref = reference.quantize_fp8_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (x.shape[0], 1)
    assert torch.equal(scale, scale_ref)
    differ = q.view(torch.uint8) != q_ref.view(torch.uint8)
    assert not differ.any(), (
        f"{int(differ.sum())} codes differ, e.g. x/scale {(x.float() / scale)[differ][:4]}"
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 64), (5, 300), (3, 4096), (2, 5000), (7, 1)], ids=str)
def test_quantize_fp8_rows_matches_reference(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    num_rows, k = shape
    x = torch.randn(num_rows, k) * torch.logspace(-4, 4, num_rows).view(-1, 1)  # rows far apart in scale
    x[num_rows // 2] = 0.0  # a row of zeros: scale 1e-12 / 448, codes 0
    assert_same_quantization(x.to(dtype).to(DEVICE))


def test_quantize_fp8_rows_rounds_every_code_and_tie_as_pytorch() -> None:
    # amax 448 makes the scale exactly 1, so x/scale is x: every e4m3 value (subnormals included),
    # every midpoint between neighbours (ties to even) and points just off them.
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (codes[1:] + codes[:-1]) / 2
    values = torch.cat([codes, mids, mids * (1 + 2**-20), mids * (1 - 2**-20)])
    x = torch.cat([torch.tensor([448.0]), values, -values])
    assert_same_quantization(x.view(1, -1).to(DEVICE))


def test_quantize_fp8_rows_strided_rows() -> None:
    x = torch.randn(6, 2 * 200, device=DEVICE)[:, ::2].contiguous()[:, :150]  # row stride 200 > 150
    assert x.stride() == (200, 1)
    assert_same_quantization(x)


def test_quantize_fp8_rows_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        quantize_fp8_rows(torch.randn(8, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match="dtype"):
        quantize_fp8_rows(torch.zeros(2, 4, dtype=torch.int32, device=DEVICE))


def fp8_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = reference.quantize_fp8_rows(torch.randn(n, k, device=DEVICE) * 0.05)
    return q, scale.view(-1)


@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=str)
@pytest.mark.parametrize("mnk", [(1, 16, 64), (3, 40, 300), (16, 33, 128), (19, 24, 100)], ids=str)
def test_fp8_matmul_w8a16_matches_reference(dtype: torch.dtype, mnk: tuple[int, int, int]) -> None:
    torch.manual_seed(1)
    m, n, k = mnk
    weight, scale = fp8_weight(n, k)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    out = fp8_matmul_w8a16(x, weight, scale, config=SMALL)
    expected = reference.fp8_matmul_w8a16(x, weight, scale)
    assert out.shape == (m, n) and out.dtype == dtype
    torch.testing.assert_close(out, expected, rtol=TOL[dtype], atol=TOL[dtype])


def test_fp8_matmul_w8a16_default_config_and_row_scale_view() -> None:
    weight, scale = fp8_weight(48, 512)
    x = torch.randn(2, 512, device=DEVICE)
    out = fp8_matmul_w8a16(x, weight, scale.view(1, -1))  # Fp8Linear keeps its scales as [1, N]
    torch.testing.assert_close(out, reference.fp8_matmul_w8a16(x, weight, scale), rtol=1e-5, atol=1e-5)


def test_fp8_matmul_w8a16_refuses_bad_input() -> None:
    weight, scale = fp8_weight(16, 64)
    with pytest.raises(ValueError, match="weight \\[N, K\\]"):
        fp8_matmul_w8a16(torch.randn(2, 32, device=DEVICE), weight, scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_matmul_w8a16(torch.randn(2, 64, device=DEVICE), weight.float(), scale)
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_matmul_w8a16(torch.randn(2, 64, device=DEVICE), weight, scale[:8])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mn", [(1, 48), (5, 1100), (3, 2048)])
def test_scale_product_matches_reference(dtype: torch.dtype, mn: tuple[int, int]) -> None:
    m, n = mn
    acc = (torch.randn(m, n, device=DEVICE) * 1e5).to(torch.bfloat16)
    row_scale = torch.rand(m, 1, device=DEVICE) * 1e-3 + 1e-4
    col_scale = torch.rand(1, n, device=DEVICE) * 1e-3 + 1e-4
    out = scale_product(acc, row_scale, col_scale, dtype)
    assert out.dtype == dtype and out.shape == (m, n)
    # One rounding step apart at most: the interpreter's float32 -> 16-bit cast truncates.
    expected = reference.scale_product(acc, row_scale, col_scale, dtype)
    torch.testing.assert_close(out, expected, rtol=TOL[dtype], atol=0)


def test_scale_product_refuses_mismatched_scales() -> None:
    acc = torch.zeros(4, 32, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="scale_product"):
        scale_product(acc, torch.ones(3, 1, device=DEVICE), torch.ones(1, 32, device=DEVICE), torch.float32)
