"""Rotary position embedding, rotate-half layout (GPT-NeoX / Hugging Face Llama), in place on q and k.

One program per token: it reads the token's position, the cos and sin halves of that row of
`cos_sin_cache` (float32; any scaling such as llama3's is already baked into the cache), and
rotates every head of q and of k: `(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)` in float32,
where x1 and x2 are the two halves of head_dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(
    x_ptr,  # [num_tokens, heads, head_dim] of this tensor (q or k)
    token,
    num_heads,
    stride_t,
    stride_h,
    cos,  # [BLOCK_HALF] float32
    sin,  # [BLOCK_HALF] float32
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (offs < HALF)[None, :]
    ptrs = x_ptr + token * stride_t + heads[:, None] * stride_h + offs[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(ptrs, (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(ptrs + HALF, (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [num_tokens]
    q_ptr,  # [num_tokens, num_heads, head_dim], rotated in place
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin_ptr,  # [max_position, head_dim] float32: cos in the first half, sin in the second
    num_heads,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + pos * stride_cs + offs
    cos = tl.load(row, mask=offs < HALF, other=0.0)
    sin = tl.load(row + HALF, mask=offs < HALF, other=0.0)
    _rotate(q_ptr, token, num_heads, stride_qt, stride_qh, cos, sin, HALF, BLOCK_HALF, BLOCK_HQ)
    _rotate(k_ptr, token, num_kv_heads, stride_kt, stride_kh, cos, sin, HALF, BLOCK_HALF, BLOCK_HK)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32: cos in the first half, sin in the second
) -> None:
    """Rotary position embedding in the rotate-half (GPT-NeoX / Hugging Face Llama) layout."""
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(
            "rotary_embedding: want q [num_tokens, num_heads, head_dim], "
            "k [num_tokens, num_kv_heads, head_dim]; "
            f"got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    num_tokens, num_heads, head_dim = q.shape
    if head_dim % 2 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"rotary_embedding: want an even head_dim and cos_sin_cache [max_position, {head_dim}]; "
            f"got cos_sin_cache {tuple(cos_sin_cache.shape)}"
        )
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(-1) != 1:
        raise ValueError(
            f"rotary_embedding: cos_sin_cache must be float32, contiguous rows; got {cos_sin_cache.dtype}"
        )
    if positions.shape != (num_tokens,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"rotary_embedding: want positions int64 [{num_tokens}]; "
            f"got {positions.dtype} {tuple(positions.shape)}"
        )
    for name, t in (("q", q), ("k", k)):
        if t.dtype not in _DTYPES or t.stride(-1) != 1:
            raise ValueError(f"rotary_embedding: {name} must be {_DTYPES} contiguous in head_dim")
    for name, t in (("k", k), ("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        if t.device != q.device:
            raise ValueError(f"rotary_embedding: {name} on {t.device}, q on {q.device}")
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache, num_heads, k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        num_warps=4,
    )  # fmt: skip
