"""KV cache write: scatter this step's K and V into their paged-cache slots.

One program per token: it reads the token's slot (`block_id * block_size + offset`; a negative slot
is padding and is skipped), and copies its [num_kv_heads, head_dim] rows of K and V into
`cache[block_id, offset]`, converting to the cache's dtype. Slot offsets are int64: a cache of
100k blocks x 16 slots x 8 heads x 128 dims already has 1.6e9 elements.

An fp8 (e4m3) cache stores `x * (1 / scale)`, clamped to +-448 and rounded to the nearest e4m3 by
`quant._e4m3` (ties to even, as PyTorch's cast; the GPU's conversion, or by hand in the interpreter,
see quant.py), one per-tensor scale for K and one for V.

Two layouts of a layer's cache, both seen as [num_blocks, block_size, num_kv_heads, head_dim] views
(`cache_view`): slot-major, each slot's heads and dims contiguous, and token-major, each (block, head,
dim) holding its block_size slots contiguously, as vLLM's value cache does. The engine keeps an fp8 V
cache token-major: attention's P @ V then reduces along contiguous memory, as Q @ K^T does, which
8-bit operands need (`attention._load_v_token_major`). Writing it scatters bytes block_size apart.

The cache holds no NaN or inf: written values are made finite (`_finite`: NaN as 0, +-inf as the cache
dtype's largest value, before an fp8 cache's clamp) and the engine zeroes the cache when it allocates it.
Attention then reads a context's last tile whole, past the context's end, and masks only its scores
(`attention.DecodeConfig.finite_cache`): a probability of 0 times any finite value adds nothing, where a
NaN left by a request that overflowed would poison every later sequence given its block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.pdl import await_inputs
from pagoda.kernels.quant import _e4m3


@triton.jit
def _finite(x, MAX: tl.constexpr):
    """x in float32, NaN as 0 and every value within +-MAX (`finite_bound`): what the cache may hold."""
    x = x.to(tl.float32)
    x = tl.where(x == x, x, 0.0)
    return tl.minimum(tl.maximum(x, -MAX), MAX)


def finite_bound(cache_dtype: torch.dtype) -> float:
    """`_finite`'s MAX for a cache of this dtype: its largest value; float32's for an fp8 cache, whose
    quantization clamps to +-448 after the scale."""
    return torch.finfo(torch.float32 if cache_dtype == FP8_CACHE else cache_dtype).max


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens]
    num_kv_heads,
    k_scale,  # used when QUANT
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,  # 1, or block_size for a token-major cache (`cache_view`)
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,  # the cache is fp8: divide by the scale, clamp, round to e4m3
    CACHE_MAX: tl.constexpr,  # finite_bound
    PDL: tl.constexpr,  # pdl.flags: launched early, waits in await_inputs
):
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    mask = (heads < num_kv_heads)[:, None]
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    k_dst = (
        k_cache_ptr
        + block_id * stride_kcb
        + offset * stride_kcs
        + heads[:, None] * stride_kch
        + dims[None, :] * stride_kcd
    )
    v_dst = (
        v_cache_ptr
        + block_id * stride_vcb
        + offset * stride_vcs
        + heads[:, None] * stride_vch
        + dims[None, :] * stride_vcd
    )
    k = _finite(k, CACHE_MAX)
    v = _finite(v, CACHE_MAX)
    if QUANT:
        k = _e4m3(k, k_scale)
        v = _e4m3(v, v_scale)
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_CACHE = torch.float8_e4m3fn


def cache_view(
    flat: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int, token_major: bool
) -> torch.Tensor:  # [num_blocks, block_size, num_kv_heads, head_dim]
    """A layer's cache, stored as `flat` [num_blocks, block_size * num_kv_heads * head_dim] (contiguous),
    seen in the layout the kernels index: slot-major, or token-major (strides (B*H*D, 1, D*B, B))."""
    num_blocks = flat.shape[0]
    if not token_major:
        return flat.view(num_blocks, block_size, num_kv_heads, head_dim)
    return flat.view(num_blocks, num_kv_heads, head_dim, block_size).permute(0, 3, 1, 2)


def token_major_copy(cache: torch.Tensor) -> torch.Tensor:
    """A slot-major cache's values in a new token-major one (benchmarks and tests)."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    flat = cache.permute(0, 2, 3, 1).contiguous().view(num_blocks, -1)
    return cache_view(flat, block_size, num_kv_heads, head_dim, token_major=True)


def is_token_major(cache: torch.Tensor) -> bool:
    """Whether a [num_blocks, block_size, num_kv_heads, head_dim] cache view is `cache_view`'s
    token-major layout: each (block, head, dim)'s slots contiguous."""
    if cache.dim() != 4 or cache.shape[1] < 2:
        return False
    block_size, head_dim = cache.shape[1], cache.shape[3]
    return cache.stride()[1:] == (1, head_dim * block_size, block_size)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; a negative slot is skipped (graph padding)
    k_scale: float = 1.0,  # an fp8 cache holds key / k_scale
    v_scale: float = 1.0,
) -> None:
    """Scatter the new tokens' K and V into their cache slots."""
    check_write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if key.shape[0] == 0:
        return
    _write_kv_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping, key.shape[1], float(k_scale), float(v_scale),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *k_cache.stride(), *v_cache.stride(),
        HEAD_DIM=key.shape[2], BLOCK_H=triton.next_power_of_2(key.shape[1]), BLOCK_SIZE=k_cache.shape[1],
        QUANT=k_cache.dtype == FP8_CACHE, CACHE_MAX=finite_bound(k_cache.dtype), num_warps=4,
        **pdl.flags(key),
    )  # fmt: skip


def check_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> None:
    """`write_kv`'s arguments, or a ValueError that says which is wrong."""
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"write_kv: want key == value shapes [num_tokens, num_kv_heads, head_dim]; "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            "write_kv: want k_cache == v_cache shapes "
            f"[num_blocks, block_size, {key.shape[1]}, {key.shape[2]}]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"write_kv: want slot_mapping int64 [{key.shape[0]}]; "
            f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    for name, t, allowed in (
        ("key", key, _DTYPES),
        ("value", value, _DTYPES),
        ("k_cache", k_cache, (*_DTYPES, FP8_CACHE)),
        ("v_cache", v_cache, (k_cache.dtype,)),
    ):
        if t.dtype not in allowed:
            raise ValueError(f"write_kv: {name} dtype {t.dtype} not in {allowed}")
        if t.stride(-1) != 1 and not (name == "v_cache" and is_token_major(t)):
            raise ValueError(
                f"write_kv: {name} must be contiguous in head_dim (or token-major, for v_cache), "
                f"strides {t.stride()}"
            )
        if t.device != key.device:
            raise ValueError(f"write_kv: {name} on {t.device}, key on {key.device}")
    head_dim = key.shape[2]
    if head_dim & (head_dim - 1):
        raise ValueError(f"write_kv: head_dim {head_dim} must be a power of two")
    if slot_mapping.device != key.device or slot_mapping.stride(0) != 1:
        raise ValueError("write_kv: slot_mapping must be contiguous and on key's device")
    if key.shape[0] and not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"write_kv: k_scale {k_scale} and v_scale {v_scale} must be positive")
