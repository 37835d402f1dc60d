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

`fp8_gemv` is the same product for 1 to 8 rows (decode at low load) without `tl.dot`: at that many
rows the tensor cores idle either way and the job is streaming the weight bytes at the HBM rate,
which needs many small programs (occupancy) each with several loads in flight, not MMA tiles. Each
program owns BLOCK_N weight rows and every input row, walks its K range in BLOCK_K chunks (through
shared memory `num_stages` deep, by `cp.async`, when num_stages > 1), upcasts the e4m3 tile to
float32 and accumulates with CUDA-core FMAs. The tile is [BLOCK_N, T, VEC] with T * VEC = BLOCK_K:
VEC contiguous elements of a weight row per thread (8 for 16-bit x, 16 bytes of it; 4 for float32)
and T along the lanes and warps (all of them when block_k >= 32 * num_warps * VEC), so a thread
holds all BLOCK_N rows of its K slice and reads each x value once for all of them; each x row is a
[T, VEC] load in the matching layout (no shuffle or shared-memory exchange in the loop). A row's
products are summed over VEC in one chain of FMAs into a float32 [BLOCK_N, T] accumulator (a tuple
of them, one per input row: rows are unrolled at compile time, so M is a constexpr and 1..8 rows
compile 8 variants); lanes and warps are summed once after the loop, the row scales applied, and the
result rounded once. With split_k > 1 the programs along K write float32 partials and a second
launch sums them in order, scales and rounds. `silu_mul=True` takes the gate_up projection's output
[M, 2K] and computes `silu(gate) * up` on the fly, rounded as `activation.silu_and_mul` rounds
(bit-identical to it then `fp8_gemv` with the same config): down_proj at batch 1 without a launch
for the activation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Fp8GemmConfig:
    # Untuned defaults; `python -m pagoda.kernels.bench_fp8 --sweep` times the alternatives.
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


@dataclass(frozen=True)
class GemvConfig:
    # Untuned defaults; `python -m pagoda.kernels.bench_fp8 --gemv` times the alternatives.
    block_n: int = 8  # output columns (weight rows) per program
    block_k: int = 512  # K elements per loop iteration
    split_k: int = 1  # > 1: programs along K write float32 partials, a second launch sums them
    num_warps: int = 4
    num_stages: int = 3  # > 1: the loop's loads go through shared memory by cp.async, this deep


GEMV_MAX_ROWS = 8


@triton.jit
def _fma_last_axis(acc, w, x, VEC: tl.constexpr):
    # acc [BLOCK_N, T] + sum over v of w[BLOCK_N, T, v] * x[1, T, v], as one chain of FMAs an output
    # (`tl.sum` adds in a tree: a multiply, an FMA and an add per two products, 1.5 instructions a product).
    if VEC == 1:
        res = tl.fma(tl.reshape(w, [w.shape[0], w.shape[1]]), tl.reshape(x, [1, x.shape[1]]), acc)
    else:
        w_even, w_odd = tl.split(tl.reshape(w, [w.shape[0], w.shape[1], VEC // 2, 2]))
        x_even, x_odd = tl.split(tl.reshape(x, [1, x.shape[1], VEC // 2, 2]))
        res = _fma_last_axis(_fma_last_axis(acc, w_even, x_even, VEC // 2), w_odd, x_odd, VEC // 2)
    return res


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    return tl.load(ptrs) if EVEN else tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _gemv_input(x_row, K, ks, k_mask, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr):
    # A [T, VEC] chunk of one input row in float32; with SILU_MUL, `silu(gate) * up` of x_row's two
    # halves, rounded to x's dtype as `activation._silu_and_mul_kernel` rounds it.
    if SILU_MUL:
        gate = _load(x_row + ks, k_mask, EVEN_K)
        up = _load(x_row + K + ks, k_mask, EVEN_K)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        x = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    else:
        x = _load(x_row + ks, k_mask, EVEN_K)
    return x.to(tl.float32)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [ROWS, K] (SILU_MUL: [ROWS, 2K]) float16/bfloat16/float32
    w_ptr,  # [N, K] float8_e4m3fn
    scale_ptr,  # [N] float32
    out_ptr,  # [ROWS, N] x's dtype; PARTIAL: [split_k, ROWS, N] float32, unscaled
    N,
    K,
    k_split,  # K elements per program along axis 1, a multiple of BLOCK_K
    stride_x,
    stride_w,
    stride_o,  # row stride of out
    stride_split,  # PARTIAL: stride of out between splits
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,  # contiguous K elements per thread and load (8 for 16-bit x: 16-byte x loads)
    NUM_STAGES: tl.constexpr,
    SILU_MUL: tl.constexpr,
    PARTIAL: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no column mask
):
    T: tl.constexpr = BLOCK_K // VEC
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, T)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [T, VEC]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None, None] * stride_w + ks[None, :, :]  # N * K can pass 2^31
    accs = ()  # one [BLOCK_N, T] accumulator per input row (no * in Triton's tuples: concatenated)
    for _ in tl.static_range(ROWS):
        accs = accs + (tl.zeros([BLOCK_N, T], dtype=tl.float32),)  # type: ignore[assignment]  # noqa: RUF005
    k_lo = tl.program_id(1) * k_split
    k_hi = tl.minimum(K, k_lo + k_split)
    for start in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        k_mask = start + ks < K
        w_mask = col_mask[:, None, None] & k_mask[None, :, :]
        w = _load(w_ptrs + start, w_mask, EVEN_K and EVEN_N).to(tl.float32)  # exact: e4m3 fits float32
        new_accs = ()
        for r in tl.static_range(ROWS):
            x = _gemv_input(x_ptr + r * stride_x + start, K, ks, k_mask, SILU_MUL, EVEN_K)
            new_accs = new_accs + (_fma_last_axis(accs[r], w, x[None, :, :], VEC),)  # type: ignore[assignment]  # noqa: RUF005
        accs = new_accs
    if not PARTIAL:
        scale = tl.load(scale_ptr + cols, mask=col_mask, other=0.0)
    for r in tl.static_range(ROWS):
        acc = tl.sum(accs[r], axis=1)
        if PARTIAL:
            o_ptrs = out_ptr + tl.program_id(1) * stride_split + r * stride_o + cols
            tl.store(o_ptrs, acc, mask=col_mask)
        else:
            out = (acc * scale).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + r * stride_o + cols, out, mask=col_mask)


@triton.jit
def _gemv_split_sum_kernel(
    part_ptr,  # [SPLIT_K, M, N] float32
    scale_ptr,  # [N] float32
    out_ptr,  # [M, N] contiguous
    N,
    numel,  # M * N
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):  # in split order: the result does not depend on timing
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    scale = tl.load(scale_ptr + offs % N, mask=mask, other=0.0)
    tl.store(out_ptr + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=mask)


def _gemv_vec(dtype: torch.dtype, cfg: GemvConfig) -> int:
    """K elements a thread loads at a time: up to 16 bytes of x, and no more than spreads the
    BLOCK_K chunk over every thread (else the warps would split the rows instead, each reading x)."""
    widest = 16 // dtype.itemsize
    return max(1, min(widest, cfg.block_k // (32 * cfg.num_warps)))


def fp8_gemv(
    x: torch.Tensor,  # [M, K] float16/bfloat16/float32, M <= 8 (silu_mul: [M, 2K], gate then up)
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N] float32 (any shape of N elements, e.g. [1, N])
    *,
    config: GemvConfig | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:  # [M, N] in x's dtype
    """`x @ (weight * weight_scale).T` in float32, rounded once, as `reference.fp8_matmul_w8a16`, for
    up to 8 rows; with `silu_mul`, of `activation.silu_and_mul(x)` (to the bit: the same as that
    launch, then this one with the same config) without its launch.
    With `config.split_k > 1` it is two launches (the partial products, then their sum)."""
    cfg = config or GemvConfig()
    name = "fp8_gemv"
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"{name}: want x [M, K] and weight [N, K]; got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    num_rows, n = x.shape[0], weight.shape[0]
    k = x.shape[1] // 2 if silu_mul else x.shape[1]
    if (silu_mul and x.shape[1] % 2) or k != weight.shape[1]:
        want = "[M, 2K] (gate | up)" if silu_mul else "[M, K]"
        raise ValueError(
            f"{name}: want x {want} and weight [N, K]; got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if num_rows > GEMV_MAX_ROWS:
        raise ValueError(
            f"{name}: at most {GEMV_MAX_ROWS} rows, got {num_rows} (fp8_matmul_w8a16 takes more)"
        )
    if x.dtype not in _DTYPES:
        raise ValueError(f"{name}: x dtype {x.dtype} not in {_DTYPES}")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: weight dtype {weight.dtype}, want torch.float8_e4m3fn")
    if weight_scale.numel() != n or weight_scale.dtype != torch.float32 or not weight_scale.is_contiguous():
        raise ValueError(f"{name}: weight_scale must be {n} contiguous float32 values")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(
            f"{name}: x and weight must be contiguous in K, strides {x.stride()}, {weight.stride()}"
        )
    for field in ("block_n", "block_k"):
        if getattr(cfg, field) < 1 or getattr(cfg, field) & (getattr(cfg, field) - 1):
            raise ValueError(f"{name}: {field} must be a power of two, got {getattr(cfg, field)}")
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    # Whole BLOCK_K chunks per split, and no split left without one.
    k_split = max(1, triton.cdiv(triton.cdiv(k, max(1, cfg.split_k)), cfg.block_k)) * cfg.block_k
    split_k = max(1, triton.cdiv(k, k_split))
    partial = split_k > 1
    dest = torch.empty((split_k, num_rows, n), dtype=torch.float32, device=x.device) if partial else out
    _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n), split_k)](
        x, weight, weight_scale, dest, n, k, k_split, x.stride(0), weight.stride(0), dest.stride(-2),
        dest.stride(0) if partial else 0, ROWS=num_rows, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        VEC=_gemv_vec(x.dtype, cfg), NUM_STAGES=cfg.num_stages, SILU_MUL=silu_mul, PARTIAL=partial,
        EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    if partial:
        block = 1024
        _gemv_split_sum_kernel[(triton.cdiv(num_rows * n, block),)](
            dest, weight_scale, out, n, num_rows * n, SPLIT_K=split_k, BLOCK=block, num_warps=4
        )
    return out
