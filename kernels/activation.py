"""SiLU-and-mul, the gate of SwiGLU: `out = silu(x[:, :d]) * x[:, d:]`.

Programs tile (token, BLOCK columns of d). The gate's `silu(g) = g * sigmoid(g)` is computed in
float32 and rounded to x's dtype before the product, as PyTorch's two-op reference rounds it, so
bf16 results match the reference to the last bit in most elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_tokens, 2 * d]
    out_ptr,  # [num_tokens, d]
    d,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def silu_and_mul(
    x: torch.Tensor,  # [num_tokens, 2 * d]
    *,
    out: torch.Tensor | None = None,  # [num_tokens, d], written when given
) -> torch.Tensor:  # [num_tokens, d]
    """SwiGLU's gate: `silu(x[:, :d]) * x[:, d:]`."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul: want x [num_tokens, 2 * d]; got {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"silu_and_mul: x dtype {x.dtype} not in {_DTYPES}")
    if x.stride(-1) != 1:
        raise ValueError(f"silu_and_mul: x must be contiguous in its last dim, strides {x.stride()}")
    num_tokens, d = x.shape[0], x.shape[1] // 2
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
        x, out, d, x.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out
