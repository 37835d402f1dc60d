"""Two partial attentions of the same queries, over disjoint keys, merged by their log-sum-exp into the
engine's [tokens, heads, head_dim] layout: `cudnn_attention`'s prefix part and causal part.

One pass: each program reads a BLOCK_T x HEAD_DIM tile of both parts (any strides, as cuDNN lays them
out) and both log-sum-exps, weighs them in float32 and writes the tile once, v_scale applied. In
PyTorch the same merge takes five passes over float32 copies (`reference.merge_attention`, the CPU's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.pdl import await_inputs


# num_tokens, a chunk's length (8,192 or 8,192 less the decoding rows beside it), only masks the last
# tile: specialized, the first chunk of each kind would compile it inside a step.
@triton.jit(do_not_specialize=["num_tokens"])
def _merge_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    a_ptr,  # [num_heads, num_tokens, head_dim]
    a_lse_ptr,  # [num_heads, num_tokens] float32, natural log
    b_ptr,  # [num_heads, num_tokens, head_dim]
    b_lse_ptr,  # [num_heads, num_tokens] float32
    num_tokens,
    v_scale,
    stride_ot, stride_oh,
    stride_ah, stride_at, stride_alh, stride_alt,
    stride_bh, stride_bt, stride_blh, stride_blt,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    PDL: tl.constexpr,  # pdl.flags: launched early, waits in await_inputs
):  # fmt: skip
    await_inputs(PDL)
    head = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < num_tokens
    dims = tl.arange(0, HEAD_DIM)
    t64 = t.to(tl.int64)
    a_lse = tl.load(a_lse_ptr + head * stride_alh + t64 * stride_alt, mask=ok, other=0.0)
    b_lse = tl.load(b_lse_ptr + head * stride_blh + t64 * stride_blt, mask=ok, other=0.0)
    top = tl.maximum(a_lse, b_lse)
    a_w = tl.exp(a_lse - top)
    b_w = tl.exp(b_lse - top)
    norm = v_scale / (a_w + b_w)
    a = tl.load(a_ptr + head * stride_ah + t64[:, None] * stride_at + dims[None, :], mask=ok[:, None])
    b = tl.load(b_ptr + head * stride_bh + t64[:, None] * stride_bt + dims[None, :], mask=ok[:, None])
    out = a.to(tl.float32) * (a_w * norm)[:, None] + b.to(tl.float32) * (b_w * norm)[:, None]
    o_ptrs = out_ptr + t64[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def merge_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written
    a: torch.Tensor,  # [num_heads, num_tokens, head_dim], contiguous in head_dim
    a_lse: torch.Tensor,  # [num_heads, num_tokens] float32
    b: torch.Tensor,
    b_lse: torch.Tensor,
    v_scale: float = 1.0,
) -> None:
    """`out` = the softmax-weighted sum of the two parts (each normalized over its own keys), times
    v_scale."""
    num_tokens, num_heads, head_dim = out.shape
    for t in (a, b):
        if t.shape != (num_heads, num_tokens, head_dim) or t.stride(-1) != 1:
            raise ValueError(f"merge_attention: parts must be [{num_heads}, {num_tokens}, {head_dim}]")
    if out.stride(-1) != 1 or head_dim & (head_dim - 1):
        raise ValueError(f"merge_attention: out {tuple(out.shape)} strides {out.stride()}")
    block_t = 16
    _merge_kernel[(triton.cdiv(num_tokens, block_t), num_heads)](
        out, a, a_lse, b, b_lse, num_tokens, float(v_scale),
        out.stride(0), out.stride(1),
        a.stride(0), a.stride(1), a_lse.stride(0), a_lse.stride(1),
        b.stride(0), b.stride(1), b_lse.stride(0), b_lse.stride(1),
        HEAD_DIM=head_dim, BLOCK_T=block_t, **pdl.flags(out),
    )  # fmt: skip
