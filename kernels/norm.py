"""Fused RMSNorm with the residual add in front.

One program per row (token). With a residual, the program computes `x + residual` rounded to x's
dtype (as PyTorch does) and stores it as the new residual, then normalizes it in float32:
`normed = x * rsqrt(mean(x^2) + eps)`, rounds `normed` to x's dtype and multiplies by the weight
(Hugging Face Llama's order of operations, see `reference.rms_norm`). The whole row lives in
registers: one read of each input and one write of each output.

With `quantize=True` the normalized row is not stored: the program quantizes it to fp8 (e4m3) with
one scale for the row, exactly as `quant.quantize_fp8_rows` would from the stored row, and writes the
codes and the scale: the input of an fp8 projection, one launch (and one bf16 round trip) fewer.

With `scales=(row, column)`, `x` is an fp8 projection's product that `torch._scaled_mm` ran with unit
scales (o_proj's, down_proj's): the program first scales it as `quant.scale_product` would, into
`scaled_dtype`, and that is the x of the rest. The projection's own scaling launch goes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.pdl import await_inputs
from pagoda.kernels.quant import FP8_DTYPE, _e4m3, _row_scale


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden]; x_ptr when not HAS_RESIDUAL
    weight_ptr,  # [hidden]
    out_ptr,  # [num_tokens, hidden]; fp8 codes when QUANT
    residual_out_ptr,  # [num_tokens, hidden]; x_ptr when not HAS_RESIDUAL
    scale_ptr,  # [num_tokens] float32 when QUANT
    row_scale_ptr,  # [num_tokens] float32 when SCALED
    col_scale_ptr,  # [hidden] float32 when SCALED
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    OUT_DTYPE: tl.constexpr,  # the normalized row's dtype (rounded to it before quantizing)
    SCALED: tl.constexpr,  # x is an unscaled fp8 product: scale it into X_DTYPE first
    X_DTYPE: tl.constexpr,
    PDL: tl.constexpr,  # pdl.flags: launched early, waits in await_inputs
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if SCALED:  # as `quant.scale_product`: (acc * row scale) * column scale in float32, rounded once
        col_scale = tl.load(col_scale_ptr + cols, mask=mask, other=0.0)
        x = ((x.to(tl.float32) * tl.load(row_scale_ptr + row)) * col_scale).to(X_DTYPE)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (w * normed).to(OUT_DTYPE)
    if QUANT:
        scale = _row_scale(tl.max(tl.abs(y.to(tl.float32)), 0))
        tl.store(scale_ptr + row, scale)
        y = _e4m3(y, scale)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_MAX_HIDDEN = 65536  # one row in registers: 64k float32 over 16 warps is 128 per thread


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
    *,
    out: torch.Tensor | None = None,  # [num_tokens, hidden], written when given
    residual_out: torch.Tensor | None = None,  # [num_tokens, hidden], written when given with residual
    quantize: bool = False,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # (row [num_tokens, 1], column [1, hidden])
    scaled_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """RMSNorm, with the residual add fused in front when `residual` is given.

    Returns `(normed, x + residual)`, by default as new tensors (inputs are not modified); `normed`
    has the dtype PyTorch gives `weight * x`. `out` and `residual_out` may alias `x` and `residual`.
    With `quantize`, `normed` is `(fp8 codes [num_tokens, hidden], float32 scales [num_tokens, 1])`
    (then `out` must not be given).

    With `scales`, `x` is an fp8 product still to be scaled (float32 row and column scales) into
    `scaled_dtype`: the result is `rms_norm(scale_product(x, *scales, scaled_dtype), ...)` in one launch,
    and `residual` (and the new residual) are in `scaled_dtype`.
    """
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(
            "rms_norm: want x [num_tokens, hidden], weight [hidden]; "
            f"got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        raise ValueError(f"rms_norm: x {x.dtype} and weight {weight.dtype} must be in {_DTYPES}")
    x_dtype = x.dtype if scales is None else scaled_dtype
    if scales is not None and not (
        x_dtype in _DTYPES
        and scales[0].numel() == x.shape[0]
        and scales[1].numel() == x.shape[1]
        and scales[0].dtype == scales[1].dtype == torch.float32
        and scales[0].device == scales[1].device == x.device
    ):
        raise ValueError(
            f"rms_norm: scales are float32 [{x.shape[0]}, 1] and [1, {x.shape[1]}] on {x.device} with a "
            f"scaled_dtype in {_DTYPES}; got {[(tuple(t.shape), t.dtype) for t in scales]}, {scaled_dtype}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x_dtype):
        raise ValueError(
            f"rms_norm: residual {residual.dtype} {tuple(residual.shape)} "
            f"must match x {x_dtype} {tuple(x.shape)}"
        )
    for name, t in (("x", x), ("weight", weight), ("residual", residual)):
        if t is None:
            continue
        if t.stride(-1) != 1:
            raise ValueError(f"rms_norm: {name} must be contiguous in its last dim, strides {t.stride()}")
        if t.device != x.device:
            raise ValueError(f"rms_norm: {name} on {t.device}, x on {x.device}")
    num_tokens, hidden = x.shape
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden {hidden} > {_MAX_HIDDEN}")
    assert x_dtype is not None
    out_dtype = torch.promote_types(weight.dtype, x_dtype)
    if quantize and out is not None:
        raise ValueError("rms_norm: quantize writes new fp8 codes; out must not be given")
    scale = torch.empty((num_tokens, 1), dtype=torch.float32, device=x.device) if quantize else None
    if out is None:
        out = torch.empty(x.shape, dtype=FP8_DTYPE if quantize else out_dtype, device=x.device)
    if residual is None:
        residual_out = None
    elif residual_out is None:
        residual_out = torch.empty(x.shape, dtype=x_dtype, device=x.device)
    for name, t, dtype in (
        ("out", out, out.dtype if quantize else out_dtype),
        ("residual_out", residual_out, x_dtype),
    ):
        if t is not None and (
            t.shape != x.shape or t.dtype != dtype or t.device != x.device or t.stride(-1) != 1
        ):
            raise ValueError(
                f"rms_norm: {name} must be {dtype} {tuple(x.shape)} on {x.device}, contiguous rows"
            )
    normed = (out, scale) if scale is not None else out
    if num_tokens == 0:
        return normed, residual_out
    block = triton.next_power_of_2(hidden)
    # Without a residual, x stands in for the unused pointers.
    res_in = x if residual is None else residual
    res_out = x if residual_out is None else residual_out
    row_scale, col_scale = (t.contiguous() for t in scales) if scales is not None else (x, x)
    _rms_norm_kernel[(num_tokens,)](
        x, res_in, weight, out, res_out, x if scale is None else scale, row_scale, col_scale, hidden, eps,
        x.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0),
        BLOCK=block, HAS_RESIDUAL=residual is not None, QUANT=quantize, OUT_DTYPE=_TL_DTYPES[out_dtype],
        SCALED=scales is not None, X_DTYPE=_TL_DTYPES[x_dtype], num_warps=min(16, max(1, block // 512)),
        **pdl.flags(x),
    )  # fmt: skip
    return normed, residual_out
