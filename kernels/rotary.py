"""Rotary position embedding, rotate-half layout (GPT-NeoX / Hugging Face Llama), in place on q and k.

One program per token: it reads the token's position, the cos and sin halves of that row of
`cos_sin_cache` (float32; any scaling such as llama3's is already baked into the cache), and
rotates every head of q and of k: `(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)` in float32,
where x1 and x2 are the two halves of head_dim.

The engine's attention layers call it with `kv_write`: the same program then stores the rotated K
and the V into their KV-cache slots (`kv_cache.write_kv`'s work, fp8 cache included), one launch
where there were two. Under fp8 W8A8 it also takes q, k and v unscaled, straight from the qkv
projection's `_scaled_mm`, and applies the projection's row and column scales itself (`scales=`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.kv_cache import FP8_CACHE, _finite, check_write_kv, finite_bound
from pagoda.kernels.pdl import await_inputs
from pagoda.kernels.quant import _e4m3

# What `rotary_embedding(..., kv_write=)` stores into the cache beside the rotated K: (value, k_cache,
# v_cache, slot_mapping, k_scale, v_scale), `kv_cache.write_kv`'s arguments after the key.
KVWrite = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float]


@triton.jit
def _load_heads(
    x_ptr,  # [num_tokens, heads, head_dim]
    token,
    num_heads,
    stride_t,
    stride_h,
    row_scale,  # float32 (SCALED)
    col_ptr,  # [heads * head_dim] float32, this tensor's columns of the product's scales (SCALED)
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SCALED: tl.constexpr,  # x is an unscaled fp8 product: scale it into DTYPE, as `quant.scale_product`
    DTYPE: tl.constexpr,
):  # both halves of head_dim, [BLOCK_H, BLOCK_HALF] each
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (offs < HALF)[None, :]
    ptrs = x_ptr + token * stride_t + heads[:, None] * stride_h + offs[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    if SCALED:
        cols = col_ptr + heads[:, None] * (2 * HALF) + offs[None, :]
        x1 = ((x1.to(tl.float32) * row_scale) * tl.load(cols, mask=mask, other=0.0)).to(DTYPE)
        x2 = ((x2.to(tl.float32) * row_scale) * tl.load(cols + HALF, mask=mask, other=0.0)).to(DTYPE)
    return x1, x2


@triton.jit
def _store_heads(
    out_ptr,  # [num_tokens, heads, head_dim]
    token,
    first,  # [BLOCK_H, BLOCK_HALF]: the first half of head_dim
    second,
    num_heads,
    stride_t,
    stride_h,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (offs < HALF)[None, :]
    ptrs = out_ptr + token * stride_t + heads[:, None] * stride_h + offs[None, :]
    tl.store(ptrs, first.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, second.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate(
    x_ptr,  # [num_tokens, heads, head_dim] of this tensor (q or k)
    out_ptr,  # where the rotated heads go (x_ptr: in place), when STORE
    token,
    num_heads,
    stride_t,
    stride_h,
    stride_ot,
    stride_oh,
    cos,  # [BLOCK_HALF] float32
    sin,  # [BLOCK_HALF] float32
    row_scale,
    col_ptr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SCALED: tl.constexpr,
    DTYPE: tl.constexpr,
    STORE: tl.constexpr,
):
    x1, x2 = _load_heads(x_ptr, token, num_heads, stride_t, stride_h, row_scale, col_ptr,
                         HALF, BLOCK_HALF, BLOCK_H, SCALED, DTYPE)  # fmt: skip
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    o1 = (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype)
    o2 = (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype)
    if STORE:
        _store_heads(out_ptr, token, o1, o2, num_heads, stride_ot, stride_oh, HALF, BLOCK_HALF, BLOCK_H)
    return o1, o2


@triton.jit
def _store_slot(
    cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot,
    first,  # [BLOCK_H, BLOCK_HALF] in the activations' dtype: the first half of head_dim
    second,
    scale,  # an fp8 cache holds x * (1 / scale) (QUANT)
    num_kv_heads,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,  # 1, or block_size for a token-major cache (`kv_cache.cache_view`)
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    CACHE_MAX: tl.constexpr,  # kv_cache.finite_bound: the cache holds finite values only
):
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    if slot >= 0:  # a negative slot (graph padding) is not written
        mask = (heads < num_kv_heads)[:, None] & (offs < HALF)[None, :]
        row = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        dst = row + heads[:, None] * stride_ch + offs[None, :] * stride_cd
        # (No name from before this runtime `if` is reassigned in it: compiled, it would have to keep
        # its type across both branches.)
        if QUANT:
            tl.store(dst, _e4m3(_finite(first, CACHE_MAX), scale), mask=mask)
            tl.store(dst + HALF * stride_cd, _e4m3(_finite(second, CACHE_MAX), scale), mask=mask)
        else:
            tl.store(dst, _finite(first, CACHE_MAX).to(cache_ptr.dtype.element_ty), mask=mask)
            tl.store(
                dst + HALF * stride_cd, _finite(second, CACHE_MAX).to(cache_ptr.dtype.element_ty), mask=mask
            )


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [num_tokens]
    q_ptr,  # [num_tokens, num_heads, head_dim], rotated in place
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin_ptr,  # [max_position, head_dim] float32: cos in the first half, sin in the second
    v_ptr,  # [num_tokens, num_kv_heads, head_dim] (WRITE_KV)
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (WRITE_KV)
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] (WRITE_KV); a negative slot is not written
    k_scale,
    v_scale,
    q_out_ptr,  # [num_tokens, num_heads, head_dim] in DTYPE (q_ptr: in place)
    k_out_ptr,  # [num_tokens, num_kv_heads, head_dim] in DTYPE: the rotated K (KV_OUT)
    v_out_ptr,  # [num_tokens, num_kv_heads, head_dim] in DTYPE: the V (KV_OUT)
    row_scale_ptr,  # [num_tokens] float32 (SCALED)
    col_scale_ptr,  # [(num_heads + 2 * num_kv_heads) * head_dim] float32, q's columns, k's, v's (SCALED)
    num_heads,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    stride_vt,
    stride_vh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_vot,
    stride_voh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    WRITE_KV: tl.constexpr,  # also store the rotated K and V into their cache slots (`write_kv`)
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,  # the cache is fp8
    CACHE_MAX: tl.constexpr,  # kv_cache.finite_bound (WRITE_KV)
    SCALED: tl.constexpr,  # q, k, v are an unscaled fp8 product: scale into DTYPE first; k is not stored
    DTYPE: tl.constexpr,
    KV_OUT: tl.constexpr,  # also store the rotated K and the V in DTYPE (with WRITE_KV)
    PDL: tl.constexpr,  # pdl.flags: launched early, waits in await_inputs
):
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + pos * stride_cs + offs
    cos = tl.load(row, mask=offs < HALF, other=0.0)
    sin = tl.load(row + HALF, mask=offs < HALF, other=0.0)
    row_scale = tl.load(row_scale_ptr + token) if SCALED else 1.0
    q_cols = num_heads * 2 * HALF
    kv_cols = num_kv_heads * 2 * HALF
    _rotate(q_ptr, q_out_ptr, token, num_heads, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
            row_scale, col_scale_ptr, HALF, BLOCK_HALF, BLOCK_HQ, SCALED, DTYPE, True)  # fmt: skip
    k1, k2 = _rotate(k_ptr, k_ptr, token, num_kv_heads, stride_kt, stride_kh, stride_kt, stride_kh, cos, sin,
                     row_scale, col_scale_ptr + q_cols, HALF, BLOCK_HALF, BLOCK_HK, SCALED, DTYPE,
                     not SCALED)  # fmt: skip
    if WRITE_KV:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        v_cols = col_scale_ptr + q_cols + kv_cols
        v1, v2 = _load_heads(v_ptr, token, num_kv_heads, stride_vt, stride_vh, row_scale, v_cols,
                             HALF, BLOCK_HALF, BLOCK_HK, SCALED, DTYPE)  # fmt: skip
        _store_slot(k_cache_ptr, slot, k1, k2, k_scale, num_kv_heads, stride_kcb, stride_kcs, stride_kch,
                    stride_kcd, HALF, BLOCK_HALF, BLOCK_HK, BLOCK_SIZE, QUANT, CACHE_MAX)  # fmt: skip
        _store_slot(v_cache_ptr, slot, v1, v2, v_scale, num_kv_heads, stride_vcb, stride_vcs, stride_vch,
                    stride_vcd, HALF, BLOCK_HALF, BLOCK_HK, BLOCK_SIZE, QUANT, CACHE_MAX)  # fmt: skip
        if KV_OUT:
            _store_heads(
                k_out_ptr, token, k1, k2, num_kv_heads, stride_kot, stride_koh, HALF, BLOCK_HALF, BLOCK_HK
            )
            _store_heads(
                v_out_ptr, token, v1, v2, num_kv_heads, stride_vot, stride_voh, HALF, BLOCK_HALF, BLOCK_HK
            )


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32: cos in the first half, sin in the second
    kv_write: KVWrite | None = None,
    *,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # (row [num_tokens, 1], column [1, q+k+v])
    scaled_dtype: torch.dtype | None = None,
    q_out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim] in scaled_dtype
    kv_out: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([num_tokens, num_kv_heads, head_dim],) x 2
) -> None:
    """Rotary position embedding in the rotate-half (GPT-NeoX / Hugging Face Llama) layout. With
    `kv_write`, the same launch then stores the rotated K and the V into their cache slots, as
    `kv_cache.write_kv(k, *kv_write)` would after it.

    With `scales` (and `kv_write`, `scaled_dtype`, `q_out`), q, k and v are column ranges of an fp8
    qkv projection's product that `torch._scaled_mm` ran with unit scales: each is scaled first, as
    `quant.scale_product(qkv, *scales, scaled_dtype)` would, then the rotated q goes to `q_out` and k
    and v to the cache only (k is left as it was).

    `kv_out` (with `kv_write`): the same launch also stores the rotated K and the V, as the cache gets
    them but in q's dtype (`scaled_dtype` with `scales`), for attention over a prompt's own keys and
    values without reading them back from the cache (`cudnn_attention.prompt_attention`). `q_out`
    serves without `scales` too: the rotated q goes there, q is left as it was."""
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
    if kv_write is not None:
        check_write_kv(k, *kv_write)
    if scales is not None:
        _check_scales(q, k, kv_write, scales, scaled_dtype, q_out)
        assert q_out is not None and scaled_dtype is not None
    elif q_out is not None and (q_out.shape != q.shape or q_out.dtype != q.dtype or q_out.stride(-1) != 1):
        raise ValueError(f"rotary_embedding: q_out must be like q, {q.dtype} {tuple(q.shape)}")
    if kv_out is not None:
        _check_kv_out(k, kv_write, kv_out, scaled_dtype or q.dtype)
    if num_tokens == 0:
        return
    half = head_dim // 2
    v, k_cache, v_cache, slots, k_scale, v_scale = (
        kv_write if kv_write is not None else (k, k, k, positions, 1.0, 1.0)
    )
    q_out = q if q_out is None else q_out
    k_out, v_out = kv_out if kv_out is not None else (k, k)
    row_scale, col_scale = (t.contiguous() for t in scales) if scales is not None else (positions, positions)
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache, v, k_cache, v_cache, slots, float(k_scale), float(v_scale),
        q_out, k_out, v_out, row_scale, col_scale,
        num_heads, k.shape[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        v.stride(0), v.stride(1), q_out.stride(0), q_out.stride(1),
        k_out.stride(0), k_out.stride(1), v_out.stride(0), v_out.stride(1),
        *_cache_strides(k_cache), *_cache_strides(v_cache),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        WRITE_KV=kv_write is not None, BLOCK_SIZE=k_cache.shape[1] if kv_write is not None else 1,
        QUANT=k_cache.dtype == FP8_CACHE, CACHE_MAX=finite_bound(k_cache.dtype), SCALED=scales is not None,
        DTYPE=_TL_DTYPES[scaled_dtype or q.dtype], KV_OUT=kv_out is not None, num_warps=4, **pdl.flags(q),
    )  # fmt: skip


def _check_scales(
    q: torch.Tensor,
    k: torch.Tensor,
    kv_write: KVWrite | None,
    scales: tuple[torch.Tensor, torch.Tensor],
    scaled_dtype: torch.dtype | None,
    q_out: torch.Tensor | None,
) -> None:
    num_tokens, num_heads, head_dim = q.shape
    columns = (num_heads + 2 * k.shape[1]) * head_dim
    row, col = scales
    if kv_write is None or scaled_dtype not in _DTYPES or q_out is None:
        raise ValueError("rotary_embedding: scales go with kv_write, a scaled_dtype and q_out")
    if not (row.numel() == num_tokens and col.numel() == columns and row.dtype == col.dtype == torch.float32):
        raise ValueError(
            f"rotary_embedding: scales are float32 [{num_tokens}, 1] and [1, {columns}]; "
            f"got {[(tuple(t.shape), t.dtype) for t in scales]}"
        )
    if q_out.shape != q.shape or q_out.dtype != scaled_dtype or q_out.stride(-1) != 1:
        raise ValueError(
            f"rotary_embedding: q_out must be {scaled_dtype} {tuple(q.shape)}, contiguous in head_dim"
        )


def _check_kv_out(
    k: torch.Tensor,
    kv_write: KVWrite | None,
    kv_out: tuple[torch.Tensor, torch.Tensor],
    dtype: torch.dtype,
) -> None:
    if kv_write is None:
        raise ValueError("rotary_embedding: kv_out goes with kv_write (its launch loads V)")
    for t in kv_out:
        if t.shape != k.shape or t.dtype != dtype or t.stride(-1) != 1 or t.device != k.device:
            raise ValueError(
                f"rotary_embedding: kv_out must be {dtype} {tuple(k.shape)} on {k.device}, contiguous in "
                f"head_dim; got {[(t.dtype, tuple(t.shape), t.device) for t in kv_out]}"
            )


def _cache_strides(cache: torch.Tensor) -> tuple[int, ...]:  # (block, slot, head, dim); 0s for a stand-in
    return tuple(cache.stride()) if cache.dim() == 4 else (0, 0, 0, 0)
