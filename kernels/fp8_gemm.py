"""Skinny W8A16 GEMM for decode batches: `out = x @ (weight * weight_scale).T`, fp8 weights.

W8A16 rather than W8A8: at a handful of rows the projection is a stream of weight bytes and the
tensor cores idle either way, so quantizing the activations would buy nothing and cost a launch
(or a fused amax pass over every row before any product) and accuracy (the activations keep their
8 mantissa bits of bf16 instead of e4m3's 3). Weights stay as loaded: e4m3, one float32 scale per
row.

Each program owns BLOCK_N weight rows (output columns) and BLOCK_M input rows and walks all of K in
BLOCK_K chunks: load the e4m3 tile, upcast it in registers to x's dtype (exact: e4m3 fits in bf16
and fp16), `tl.dot` into a float32 accumulator, apply the row scales at the end, round once. No
split-K, so one launch and no workspace: BLOCK_N = 16 (the smallest `tl.dot` tile) gives 256
programs at N = 4096 and 1792 at gate_up's 28672, two or more per SM of an H200's 132. Each weight
byte is read once per BLOCK_M rows; above BLOCK_M rows the weights are read again per row block,
which is where `torch._scaled_mm` takes over (`Fp8Linear` picks by the row count).

A GEMV without `tl.dot` for 1-8 rows was tried and removed (7f4017c: FMA chains over [BLOCK_N, K-slice]
tiles, cp.async stages, optional split-K, the SiLU-and-mul in down_proj's loads). Its best tiles of a
sweep on an H200 at one row, us (qkv / o / gate_up / down of an 8B model): 12.4 / 9.2 / 46.7 / 23.3,
1.8-2.5 TB/s, against cuBLASLt's fp8 `_scaled_mm` with unit scales 9.7 / 7.1 / 32.1 / 19.6 (2.19 ms a
decode step against 2.93); the SiLU inside the loads doubled down_proj's time (each of its programs
recomputes the activation for all of K); the engine's batch-1 step went 3.38 -> 6.54 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Fp8GemmConfig:
    # Untuned defaults; `python -m pagoda.bench.kernels_fp8 --sweep` times the alternatives.
    block_m: int = 16
    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _fp8_gemm_w8a16_kernel(
    x_ptr,  # [M, K] float16/bfloat16/float32
    w_ptr,  # [N, K] float8_e4m3fn
    scale_ptr,  # [N] float32
    out_ptr,  # [M, N] x's dtype
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_o,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IS_FP32: tl.constexpr,
):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_w + ks[None, :]  # N * K can pass 2^31
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k_mask = start + ks < K
        x = tl.load(x_ptrs + start, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + start, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.trans(w.to(x.dtype))
        if IS_FP32:  # no TF32: a float32 model gets float32 products
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    scale = tl.load(scale_ptr + cols, mask=col_mask, other=0.0)
    out = acc * scale[None, :]
    o_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fp8_matmul_w8a16(
    x: torch.Tensor,  # [M, K] float16/bfloat16/float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N] float32 (any shape of N elements, e.g. [1, N])
    *,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """`x @ (weight * weight_scale).T` in float32, rounded once, as `reference.fp8_matmul_w8a16`."""
    cfg = config or Fp8GemmConfig()
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"fp8_matmul_w8a16: want x [M, K] and weight [N, K]; got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if x.dtype not in _DTYPES:
        raise ValueError(f"fp8_matmul_w8a16: x dtype {x.dtype} not in {_DTYPES}")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_matmul_w8a16: weight dtype {weight.dtype}, want torch.float8_e4m3fn")
    num_rows, k = x.shape
    n = weight.shape[0]
    if weight_scale.numel() != n or weight_scale.dtype != torch.float32 or not weight_scale.is_contiguous():
        raise ValueError(f"fp8_matmul_w8a16: weight_scale must be {n} contiguous float32 values")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(
            f"fp8_matmul_w8a16: x and weight must be contiguous in K, strides {x.stride()}, {weight.stride()}"
        )
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(num_rows, cfg.block_m))
    _fp8_gemm_w8a16_kernel[grid](
        x, weight, weight_scale, out, num_rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IS_FP32=x.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
