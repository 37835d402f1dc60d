"""Dynamic per-row fp8 (e4m3) quantization in one launch (`x ~= q * scale`, row by row), and the
scaling of an fp8 product by its row and column scales in one launch (`scale_product`).

One program per row, two passes over it in BLOCK-column chunks: the first takes the row's absolute
maximum, the second divides by `scale = max(amax, 1e-12) / 448` and casts to e4m3. A row of a
Llama-3-8B projection input is at most 14336 bf16 (28 KiB), so the second pass reads from L1/L2.

The arithmetic is `reference.quantize_fp8_rows`' to the bit: the maximum is exact in any dtype, both
divisions are IEEE round-to-nearest (`div_rn`; Triton's `/` is the approximate `div.full.f32` on
NVIDIA GPUs), and after the same clamp to +-448 the value is rounded to the nearest e4m3 with ties to
even, as PyTorch's cast. Compiled, the GPU's conversion instruction rounds; in the interpreter, whose
conversion is not exact (Triton 3.9's rounds half up and drops the carry into the exponent: 124.3
became 64, not 128), float32 and integer arithmetic round by hand first, so the cast itself is exact.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.pdl import await_inputs

FP8_MAX = 448.0  # e4m3's largest finite value
FP8_DTYPE = torch.float8_e4m3fn


@triton.jit
def _round_to_e4m3(v):  # float32 with |v| <= 448 -> the nearest e4m3 value (ties to even), as float32
    # Normal range: round the float32 bits to 3 mantissa bits, a carry moving into the exponent.
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # Below 2^-6 e4m3 is subnormal, a grid of 2^-9: |v| * 2^9 = mantissa * 2^(exponent - 14), rounded
    # to an integer with ties to even, in integer arithmetic too. (Adding and subtracting 2^14 in
    # float32 rounds the same in the interpreter but not in compiled code on an H200.)
    mantissa = (bits & 0x7FFFFF) | 0x800000
    shift = tl.minimum(14 - (((bits >> 23) & 0xFF) - 127), 31)  # >= 21 below 2^-6
    ticks = (mantissa + (1 << (shift - 1)) - 1 + ((mantissa >> shift) & 1)) >> shift
    sub = ticks.to(tl.float32) * 0.001953125  # a zero (read as 2^-127 here) gives 0 ticks
    # The sign goes back as a bit: compiled, Triton's `-sub` is `0 - sub`, which turns -0.0 into +0.0.
    signed_sub = (sub.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(v) < 0.015625, signed_sub, normal)


# Compiled, the conversion is the GPU's own (`cvt.rn.satfinite.e4m3x2.f32` on sm_89+: ties to even, as
# PyTorch's cast), a few integer operations a value fewer than `_round_to_e4m3`, which the compute-bound
# quantizing kernels (the SiLU at 14336 columns) feel. The interpreter's conversion is not exact, so
# there the rounding is by hand. tests/kernels hold both to PyTorch's cast.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton's interpreter runs the kernels
_HAND_ROUNDING = tl.constexpr(INTERPRETED)


@triton.jit
def _e4m3(x, scale):  # x * (1 / scale), clamped to +-448 and rounded to e4m3 (float32 in, e4m3 out)
    # One correctly rounded division per scale, then a multiplication a value, as vLLM quantizes: a
    # division a value (`div_rn`, ~20 instructions) made the quantizing kernels compute-bound (the SiLU
    # at 14336 columns ran at half the copy bandwidth at prefill sizes). `reference` does the same.
    q = tl.minimum(tl.maximum(x.to(tl.float32) * tl.math.div_rn(1.0, scale), -448.0), 448.0)
    if _HAND_ROUNDING:
        return _round_to_e4m3(q).to(tl.float8e4nv)
    return q.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _row_scale(amax):  # a row's scale from its absolute maximum: max(amax, 1e-12) / 448, rounded once
    return tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)


@triton.jit
def _quantize_fp8_rows_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] float8_e4m3fn
    scale_ptr,  # [M] float32
    K,
    stride_x,
    stride_q,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # pdl.flags: launched early, waits in await_inputs
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = _row_scale(tl.max(amax, 0))
    tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK):
        mask = start + cols < K
        x = tl.load(x_row + start + cols, mask=mask, other=0.0)
        tl.store(q_row + start + cols, _e4m3(x, scale), mask=mask)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def quantize_fp8_rows(
    x: torch.Tensor,  # [M, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # (float8_e4m3fn [M, K], float32 [M, 1])
    """`x` [M, K] -> (q, scale) with `x ~= q * scale` row by row, as `reference.quantize_fp8_rows`."""
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8_rows: want x [M, K]; got {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"quantize_fp8_rows: x dtype {x.dtype} not in {_DTYPES}")
    if x.stride(-1) != 1:
        raise ValueError(f"quantize_fp8_rows: x must be contiguous in its last dim, strides {x.stride()}")
    num_rows, k = x.shape
    q = torch.empty((num_rows, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scale
    # 4096 columns a chunk: 16 per thread at 8 warps, and Llama-3-8B's 4096 inputs in one chunk.
    block = min(4096, triton.next_power_of_2(max(k, 1)))
    _quantize_fp8_rows_kernel[(num_rows,)](
        x,
        q,
        scale,
        k,
        x.stride(0),
        q.stride(0),
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
        **pdl.flags(x),
    )
    return q, scale


@triton.jit
def _scale_product_kernel(
    acc_ptr,  # [M, N]
    row_scale_ptr,  # [M] float32
    col_scale_ptr,  # [N] float32
    out_ptr,  # [M, N]
    N,
    stride_acc,
    stride_out,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,  # pdl.flags: launched early, waits in await_inputs
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    acc = tl.load(acc_ptr + row * stride_acc + cols, mask=mask, other=0.0).to(tl.float32)
    col_scale = tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
    out = (acc * tl.load(row_scale_ptr + row)) * col_scale
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def scale_product(
    acc: torch.Tensor,  # [M, N], an fp8 product before its scales
    row_scale: torch.Tensor,  # [M, 1] float32
    col_scale: torch.Tensor,  # [1, N] float32
    dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] in `dtype`
    """`acc * row_scale * col_scale` in float32, as `reference.scale_product`: the per-token and
    per-weight-row scales of a product that `torch._scaled_mm` ran with unit scales (its fast path)."""
    num_rows, n = acc.shape
    if row_scale.numel() != num_rows or col_scale.numel() != n or acc.stride(-1) != 1:
        raise ValueError(
            f"scale_product: acc {tuple(acc.shape)} (last stride {acc.stride(-1)}), row_scale "
            f"{tuple(row_scale.shape)}, col_scale {tuple(col_scale.shape)}"
        )
    out = torch.empty((num_rows, n), dtype=dtype, device=acc.device)
    if num_rows == 0 or n == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _scale_product_kernel[(num_rows, triton.cdiv(n, block))](
        acc,
        row_scale.contiguous(),
        col_scale.contiguous(),
        out,
        n,
        acc.stride(0),
        out.stride(0),
        BLOCK_N=block,
        **pdl.flags(acc),
    )
    return out
