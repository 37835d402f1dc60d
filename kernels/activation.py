"""SiLU-and-mul, the gate of SwiGLU: `out = silu(x[:, :d]) * x[:, d:]`.

Programs tile (token, BLOCK columns of d). The gate's `silu(g) = g * sigmoid(g)` is computed in
float32 and rounded to x's dtype before the product, as PyTorch's two-op reference rounds it, so
bf16 results match the reference to the last bit in most elements.

`silu_and_mul(x, quantize=True)` instead returns the product as fp8 (e4m3) codes with one scale per
row, as `quant.quantize_fp8_rows` would make them from the stored product. Small batches (decode at
low load) spread each row over 1024-column tiles: one launch takes each tile's absolute maximum, a
second recomputes the product (from L2) and writes the codes with the row's scale. Larger batches take
one program per row, which holds a row of up to 16k columns in registers; a wider row loops twice.
The input of an fp8 down projection, one launch and one bf16 round trip fewer. With `scales` it also
applies the fp8 gate-up projection's scales (what `quant.scale_product` would do in a launch of its own
before it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.pdl import await_inputs
from pagoda.kernels.quant import FP8_DTYPE, _e4m3, _row_scale


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_tokens, 2 * d]
    out_ptr,  # [num_tokens, d]
    d,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # pdl.flags: launched early, waits in await_inputs
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_row(x_row, d, cols, mask, row_scale, col_scale_ptr, SCALED: tl.constexpr, DTYPE: tl.constexpr):
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0)
    if SCALED:  # an fp8 product before its scales: scale as `quant.scale_product`, rounding to DTYPE
        g_col = tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
        u_col = tl.load(col_scale_ptr + d + cols, mask=mask, other=0.0)
        g = ((gate.to(tl.float32) * row_scale) * g_col).to(DTYPE)
        u = ((up.to(tl.float32) * row_scale) * u_col).to(DTYPE)
    else:
        g = gate.to(DTYPE)
        u = up.to(DTYPE)
    g32 = g.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(DTYPE)
    return (silu.to(tl.float32) * u.to(tl.float32)).to(DTYPE).to(tl.float32)


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr,  # [num_tokens, 2 * d]
    q_ptr,  # [num_tokens, d] float8_e4m3fn
    scale_ptr,  # [num_tokens] float32
    row_scale_ptr,  # [num_tokens] float32 (SCALED)
    col_scale_ptr,  # [2 * d] float32 (SCALED)
    d,
    stride_x,
    stride_q,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,  # the row fits one BLOCK: keep it in registers, read it once
    SCALED: tl.constexpr,  # x is an fp8 product whose row and column scales are applied here
    DTYPE: tl.constexpr,  # the activations' dtype (x's, or the scaled product's)
    PDL: tl.constexpr,  # pdl.flags: launched early, waits in await_inputs
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    row_scale = tl.load(row_scale_ptr + row) if SCALED else 1.0
    if ONE_PASS:
        mask = offs < d
        y = _silu_mul_row(x_row, d, offs, mask, row_scale, col_scale_ptr, SCALED, DTYPE)
        scale = _row_scale(tl.max(tl.abs(y), 0))
        tl.store(scale_ptr + row, scale)
        tl.store(q_ptr + row * stride_q + offs, _e4m3(y, scale), mask=mask)
        return
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, d, BLOCK):
        cols = start + offs
        y = _silu_mul_row(x_row, d, cols, cols < d, row_scale, col_scale_ptr, SCALED, DTYPE)
        amax = tl.maximum(amax, tl.abs(y))
    scale = _row_scale(tl.max(amax, 0))
    tl.store(scale_ptr + row, scale)
    for start in range(0, d, BLOCK):
        cols = start + offs
        mask = cols < d
        y = _silu_mul_row(x_row, d, cols, mask, row_scale, col_scale_ptr, SCALED, DTYPE)
        tl.store(q_ptr + row * stride_q + cols, _e4m3(y, scale), mask=mask)


@triton.jit
def _silu_mul_tile_amax_kernel(
    x_ptr,  # [num_tokens, 2 * d]
    amax_ptr,  # [num_tokens, num_tiles] float32: each tile's absolute maximum
    row_scale_ptr,  # [num_tokens] float32 (SCALED)
    col_scale_ptr,  # [2 * d] float32 (SCALED)
    d,
    stride_x,
    num_tiles,
    TILE: tl.constexpr,
    SCALED: tl.constexpr,
    DTYPE: tl.constexpr,
    PDL: tl.constexpr,  # pdl.flags: launched early, waits in await_inputs
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    cols = tile * TILE + tl.arange(0, TILE)
    row_scale = tl.load(row_scale_ptr + row) if SCALED else 1.0
    y = _silu_mul_row(x_ptr + row * stride_x, d, cols, cols < d, row_scale, col_scale_ptr, SCALED, DTYPE)
    tl.store(amax_ptr + row * num_tiles + tile, tl.max(tl.abs(y), 0))


@triton.jit
def _silu_mul_tile_quant_kernel(
    x_ptr,  # [num_tokens, 2 * d]
    amax_ptr,  # [num_tokens, num_tiles] float32, from _silu_mul_tile_amax_kernel
    q_ptr,  # [num_tokens, d] float8_e4m3fn
    scale_ptr,  # [num_tokens] float32
    row_scale_ptr,
    col_scale_ptr,
    d,
    stride_x,
    stride_q,
    num_tiles,
    TILE: tl.constexpr,
    TILES_POW2: tl.constexpr,
    SCALED: tl.constexpr,
    DTYPE: tl.constexpr,
    PDL: tl.constexpr,  # pdl.flags: launched early, waits in await_inputs
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    tiles = tl.arange(0, TILES_POW2)
    amax = tl.load(amax_ptr + row * num_tiles + tiles, mask=tiles < num_tiles, other=0.0)
    scale = _row_scale(tl.max(amax, 0))
    if tile == 0:
        tl.store(scale_ptr + row, scale)
    cols = tile * TILE + tl.arange(0, TILE)
    mask = cols < d
    row_scale = tl.load(row_scale_ptr + row) if SCALED else 1.0
    y = _silu_mul_row(x_ptr + row * stride_x, d, cols, mask, row_scale, col_scale_ptr, SCALED, DTYPE)
    tl.store(q_ptr + row * stride_q + cols, _e4m3(y, scale), mask=mask)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_ONE_PASS_MAX = 16384
# Batches of up to this many rows are quantized in 1024-column tiles spread over the GPU (two launches,
# the second reading x again, from L2) instead of one program per row. On an H200 at 14336 columns, us a
# call per row against tiled: 3.4 / 3.0 at 1 row, 4.0 / 4.1 at 16 (a tie), 4.3 / 5.7 at 64 (before quantizing
# multiplied by the reciprocal scale, per row took 7.5 at 1 row and 8.3 at 64;
# `python -m pagoda.bench.kernels_fp8 --activation`, BENCHMARKS.md, 2026-12-02).
TILED_MAX_ROWS = 16
# With `scales` (the unit-scale path, which runs up to fp8.UNIT_SCALE_MAX_M rows) a row's program also
# applies both column scales. Since quantizing multiplies by the row's reciprocal scale, one program per
# row is the faster at 64 rows and more, tiles at 16 and fewer; 32, untimed, splits the difference. On an
# H200 at 14336 columns, us a call per row against tiled: 6.4 against 4.7 at 16 rows, 6.5 / 6.7 at 64,
# 7.0 / 9.2 at 128, 12.0 / 14.1 at 256 (`python -m pagoda.bench.kernels_fp8 --activation`, BENCHMARKS.md,
# 2026-12-02).
SCALED_TILED_MAX_ROWS = 32
_TILE = 1024


def silu_and_mul(
    x: torch.Tensor,  # [num_tokens, 2 * d]
    *,
    out: torch.Tensor | None = None,  # [num_tokens, d], written when given
    quantize: bool = False,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # (row [num_tokens, 1], column [1, 2d])
    scaled_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, d]
    """SwiGLU's gate: `silu(x[:, :d]) * x[:, d:]`; with `quantize`, as (fp8 codes [num_tokens, d],
    float32 scales [num_tokens, 1]).

    With `scales` (and `quantize`), `x` is an fp8 gate-up product that `torch._scaled_mm` ran with unit
    scales: the kernel applies them as `quant.scale_product(x, *scales, scaled_dtype)` would, so the
    codes are the same as that launch followed by this one, without the product's round trip."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul: want x [num_tokens, 2 * d]; got {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"silu_and_mul: x dtype {x.dtype} not in {_DTYPES}")
    if x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul: x must be contiguous in its last dim, strides {x.stride()}")
    num_tokens, d = x.shape[0], x.shape[1] // 2
    if scales is not None and not (
        quantize
        and scales[0].numel() == num_tokens
        and scales[1].numel() == 2 * d
        and scales[0].dtype == scales[1].dtype == torch.float32
    ):
        raise ValueError(
            f"silu_and_mul: scales apply with quantize=True as float32 [{num_tokens}, 1] and [1, {2 * d}]; "
            f"got {[(tuple(s.shape), s.dtype) for s in scales]}"
        )
    if quantize:
        if out is not None:
            raise ValueError("silu_and_mul: quantize writes new fp8 codes; out must not be given")
        q = torch.empty((num_tokens, d), dtype=FP8_DTYPE, device=x.device)
        scale = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device)
        row_scale, col_scale = (s.contiguous() for s in scales) if scales is not None else (scale, scale)
        dtype = (scaled_dtype or x.dtype) if scales is not None else x.dtype
        if dtype not in _TL_DTYPES:
            raise ValueError(f"silu_and_mul: scaled_dtype {dtype} not in {_DTYPES}")
        tiled_max = SCALED_TILED_MAX_ROWS if scales is not None else TILED_MAX_ROWS
        if num_tokens and d and num_tokens <= tiled_max:
            num_tiles = triton.cdiv(d, _TILE)
            amax = torch.empty((num_tokens, num_tiles), dtype=torch.float32, device=x.device)
            args = (d, x.stride(0))
            flags = {"SCALED": scales is not None, "DTYPE": _TL_DTYPES[dtype], "num_warps": 4, **pdl.flags(x)}
            _silu_mul_tile_amax_kernel[(num_tokens, num_tiles)](
                x, amax, row_scale, col_scale, *args, num_tiles, TILE=_TILE, **flags
            )
            _silu_mul_tile_quant_kernel[(num_tokens, num_tiles)](
                x, amax, q, scale, row_scale, col_scale, *args, q.stride(0), num_tiles, TILE=_TILE,
                TILES_POW2=triton.next_power_of_2(num_tiles), **flags,
            )  # fmt: skip
        elif num_tokens and d:
            # Up to 16k columns (Llama-3-8B's 14336) the row stays in registers, 32 per thread at 16
            # warps; a two-pass loop over 4096-column chunks reads it twice. At batch 1 on an H200 the
            # two-pass kernel took 10.7 us per call for 14336 columns.
            one_pass = d <= _ONE_PASS_MAX
            block = triton.next_power_of_2(d) if one_pass else 4096
            _silu_and_mul_quant_kernel[(num_tokens,)](
                x, q, scale, row_scale, col_scale, d, x.stride(0), q.stride(0), BLOCK=block,
                ONE_PASS=one_pass, SCALED=scales is not None, DTYPE=_TL_DTYPES[dtype],
                num_warps=max(4, min(16, block // 1024)), **pdl.flags(x),
            )  # fmt: skip
        return q, scale
    if out is None:
        out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)
    elif (
        out.shape != (num_tokens, d) or out.dtype != x.dtype or out.device != x.device or out.stride(-1) != 1
    ):
        raise ValueError(f"silu_and_mul: out must be {x.dtype} [{num_tokens}, {d}], contiguous rows")
    if num_tokens == 0 or d == 0:
        return out
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](
        x, out, d, x.stride(0), out.stride(0), BLOCK=block, num_warps=4, **pdl.flags(x)
    )
    return out
