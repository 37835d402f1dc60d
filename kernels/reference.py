"""Plain-PyTorch references of every kernel in `pagoda.kernels`.

They define what each kernel computes (the Triton versions are tested against them) and they are
the engine's CPU path, so they avoid per-token Python loops: attention loops over sequences only
for prefill rows and handles all decode rows in one batched computation.

Layouts shared by every attention function:
- KV cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, one tensor for K and one for V.
- A slot is `block_id * block_size + offset`.
- The flattened batch: the query tokens of sequence `s` are `q[query_start_loc[s]:query_start_loc[s+1]]`
  and are the *last* tokens of its context of `seq_lens[s]` tokens (cached prefix + new tokens), so
  a decode row has one query token and a chunked-prefill row many; attention is causal.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; a negative slot is skipped (graph padding)
    k_scale: float = 1.0,  # an fp8 cache holds key / k_scale
    v_scale: float = 1.0,
) -> None:
    """Scatter the new tokens' K and V into their cache slots, made finite (NaN as 0, +-inf as the cache
    dtype's largest value); an fp8 (e4m3) cache gets `x * (1 / scale)` in float32, clamped to +-448,
    rounded to the nearest e4m3."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        x = x[valid]
        # No NaN or inf in the cache (kv_cache.finite_bound): NaN as 0, +-inf as the largest value.
        x = torch.nan_to_num(x.float(), nan=0.0, posinf=_finite_bound(cache), neginf=-_finite_bound(cache))
        if cache.dtype == torch.float8_e4m3fn:  # (times the reciprocal: see quantize_fp8_rows)
            x = (x * torch.reciprocal(_tensor(scale, x))).clamp(-FP8_MAX, FP8_MAX)
        block_size = cache.shape[1]  # (indexed by block and slot: a token-major view has no flat view)
        cache[slots // block_size, slots % block_size] = x.to(cache.dtype)


def _finite_bound(cache: torch.Tensor) -> float:
    return torch.finfo(torch.float32 if cache.dtype == torch.float8_e4m3fn else cache.dtype).max


def _gather_context(
    cache: torch.Tensor, block_tables: torch.Tensor, num_ctx: int
) -> torch.Tensor:  # [num_seqs, num_ctx, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = math.ceil(num_ctx / block_size)
    ids = block_tables[:, :num_blocks].reshape(-1).long()
    blocks = cache.index_select(0, ids)  # [num_seqs * num_blocks, block_size, H, D]; faster than cache[ids]
    return blocks.reshape(block_tables.shape[0], num_blocks * block_size, *cache.shape[2:])[:, :num_ctx]


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including this step's tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    k_scale: float = 1.0,  # the cache holds K / k_scale (an fp8 cache; 1.0 otherwise)
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's query tokens over its paged context (GQA aware), in
    float32; the cache's values times k_scale and v_scale are the keys and values."""
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    lens = seq_lens.tolist()
    starts = query_start_loc.tolist()

    decode_rows = [s for s, n in enumerate(query_lens) if n == 1]
    if decode_rows:
        rows = torch.tensor(decode_rows, device=q.device)
        num_ctx = max(lens[s] for s in decode_rows)
        k = _gather_context(k_cache, block_tables[rows], num_ctx).float() * k_scale  # [B, T, Hkv, D]
        v = _gather_context(v_cache, block_tables[rows], num_ctx).float() * v_scale
        token_idx = query_start_loc[rows].long()
        positions = torch.arange(num_ctx, device=q.device).view(1, 1, 1, -1)
        mask = positions < seq_lens[rows].view(-1, 1, 1, 1)  # [B, 1, 1, T]
        # Rows shorter than the longest read slots nobody wrote: zero them, or a NaN bit pattern left
        # there would survive as 0 * NaN in the weighted sum although its weight is 0.
        valid = mask.view(len(decode_rows), num_ctx, 1, 1)
        k = k.masked_fill(~valid, 0.0)
        v = v.masked_fill(~valid, 0.0)
        o = F.scaled_dot_product_attention(
            q[token_idx].unsqueeze(2).float(),  # [B, H, 1, D]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[token_idx] = o.squeeze(2).to(q.dtype)

    for s, n in enumerate(query_lens):
        if n <= 1:
            continue
        ctx = lens[s]
        k = _gather_context(k_cache, block_tables[s : s + 1], ctx)[0]  # [T, Hkv, D]
        v = _gather_context(v_cache, block_tables[s : s + 1], ctx)[0]
        qs = q[starts[s] : starts[s] + n]  # [n, H, D]
        # Query i sits at position ctx - n + i and sees positions <= that.
        q_pos = torch.arange(ctx - n, ctx, device=q.device).view(-1, 1)
        mask = torch.arange(ctx, device=q.device).view(1, -1) <= q_pos  # [n, T]
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1).float(),
            k.transpose(0, 1).float().repeat_interleave(group, dim=0) * k_scale,
            v.transpose(0, 1).float().repeat_interleave(group, dim=0) * v_scale,
            attn_mask=mask,
            scale=scale,
        )
        out[starts[s] : starts[s] + n] = o.transpose(0, 1).to(q.dtype)
    return out


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm, with the residual add fused in front when `residual` is given.

    Returns `(normed, x + residual)`; the sum is rounded to x's dtype before the norm, which is
    computed in float32 (Hugging Face Llama's order of operations, so greedy outputs match).
    """
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * d] -> [num_tokens, d]
    """SwiGLU's gate: `silu(x[:, :d]) * x[:, d:]`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32: cos in the first half, sin in the second
) -> None:
    """Rotary position embedding in the rotate-half (GPT-NeoX / Hugging Face Llama) layout."""
    half = q.shape[-1] // 2
    cos_sin = cos_sin_cache[positions]
    cos = cos_sin[:, :half].unsqueeze(1)
    sin = cos_sin[:, half:].unsqueeze(1)
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x.copy_(rotated.to(x.dtype))


FP8_MAX = 448.0  # e4m3's largest finite value


def _tensor(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=like.device)


def quantize_fp8_rows(
    x: torch.Tensor,  # [M, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # (float8_e4m3fn [M, K], float32 [M, 1])
    """Per-row fp8 (e4m3): `x ~= q * scale` with `scale = max(amax(|x|), 1e-12) / 448` and
    `q = x * (1 / scale)`, the reciprocal correctly rounded once a row (as the kernels, `quant._e4m3`)."""
    # A tensor divisor: PyTorch on CUDA turns `/ number` into a multiplication by its reciprocal,
    # which is not the correctly rounded quotient the kernels compute.
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / _tensor(FP8_MAX, x)
    q = (x.float() * torch.reciprocal(scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_matmul_w8a16(
    x: torch.Tensor,  # [M, K] in the model dtype
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N] float32, one scale per weight row
) -> torch.Tensor:  # [M, N] in x's dtype
    """`x @ (weight * weight_scale).T` with unquantized activations, in float32, rounded once."""
    return ((x.float() @ weight.float().t()) * weight_scale.view(1, -1)).to(x.dtype)


def scale_product(
    acc: torch.Tensor,  # [M, N], an fp8 product before its scales
    row_scale: torch.Tensor,  # [M, 1] float32, one scale per activation row
    col_scale: torch.Tensor,  # [1, N] float32, one scale per weight row
    dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] in `dtype`
    """`acc * row_scale * col_scale` in float32, rounded once to `dtype`."""
    return ((acc.float() * row_scale.view(-1, 1)) * col_scale.view(1, -1)).to(dtype)


# Multi-LoRA layouts (`lora_shrink`, `lora_expand`): adapters sit in slots; a token's slot is -1 when it
# has none. A merged projection (q/k/v, gate/up) has S slices: slice s owns the output columns
# `slice_starts[s]:slice_starts[s + 1]`, and each slot holds one A and one B per slice.
# - A: `[num_slots, S, R, K]`, each slot's A of each slice; an adapter of rank r < R fills rows :r and
#   leaves the rest zero.
# - B: `[num_slots, N, R]`, each slot's B of the S slices stacked along N (alpha / r folded in); columns
#   r: are zero for an adapter of rank r.
# - The shrink's product v: `[S, T, R]` float32.


def lora_shrink(
    x: torch.Tensor,  # [T, K]
    a: torch.Tensor,  # [num_slots, S, R, K]
    token_slots: torch.Tensor,  # [T] int32, -1: no adapter
) -> torch.Tensor:  # [S, T, R] float32
    """`v[s, t] = a[slot(t), s] @ x[t]` in float32 for every slice; zero rows for tokens of slot -1."""
    num_slices, rank = a.shape[1], a.shape[2]
    v = torch.zeros(num_slices, x.shape[0], rank, dtype=torch.float32, device=x.device)
    for slot in token_slots.unique().tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero().squeeze(1)
        v[:, rows] = x[rows].float() @ a[slot].float().transpose(1, 2)  # [T', K] @ [S, K, R]
    return v


def lora_expand(
    v: torch.Tensor,  # [S, T, R] float32
    b: torch.Tensor,  # [num_slots, N, R]
    token_slots: torch.Tensor,  # [T] int32, -1: no adapter
    y: torch.Tensor,  # [T, N], added to in place
    slice_starts: tuple[int, ...],  # S + 1 column offsets into y and b
) -> None:
    """`y[t, n] += v[s, t] @ b[slot(t), n]` for the slice s that owns column n, summed in float32 with
    y's value and rounded once to y's dtype; rows of tokens of slot -1 are left as they are."""
    for slot in token_slots.unique().tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero().squeeze(1)
        delta = torch.cat(
            [
                v[s, rows] @ b[slot, lo:hi].float().t()  # [T', R] @ [R, hi - lo]
                for s, (lo, hi) in enumerate(itertools.pairwise(slice_starts))
            ],
            dim=1,
        )
        y[rows] = (y[rows].float() + delta).to(y.dtype)


def merge_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written
    a: torch.Tensor,  # [num_heads, num_tokens, head_dim]
    a_lse: torch.Tensor,  # [num_heads, num_tokens] float32, natural log
    b: torch.Tensor,
    b_lse: torch.Tensor,
    v_scale: float = 1.0,
) -> None:
    """Two partial attentions of the same queries over disjoint keys, merged by their log-sum-exp."""
    lse = torch.logaddexp(a_lse, b_lse)
    merged = a.float() * (a_lse - lse).exp().unsqueeze(-1)
    merged.addcmul_(b.float(), (b_lse - lse).exp().unsqueeze(-1))
    out.copy_((merged * v_scale).transpose(0, 1))


# --- seeded noise: the counter-based hash of `kernels.seeded_noise` ---------------------------------

_FMIX_C1, _FMIX_C2 = 0x85EBCA6B - (1 << 32), 0xC2B2AE35 - (1 << 32)  # as int32
# Rows hashed at a time: bounds the temporaries to a few SEEDED_ROWS_PER_CHUNK x columns x 4 bytes
# (16 MB each at 32 rows of a 128k vocabulary), whatever the number of seeded rows.
SEEDED_ROWS_PER_CHUNK = 32


def _shr32(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 bit patterns (torch's >> on int32 is arithmetic)."""
    return (x >> bits) & ((1 << (32 - bits)) - 1)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on int32 bit patterns (products wrap modulo 2**32, as in C)."""
    x = x ^ _shr32(x, 16)
    x = x * _FMIX_C1
    x = x ^ _shr32(x, 13)
    x = x * _FMIX_C2
    return x ^ _shr32(x, 16)


def seeded_uniform_chunks(keys: torch.Tensor, columns: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, [<= SEEDED_ROWS_PER_CHUNK, columns] float32 uniforms in (0, 1)) for the rows of
    `keys` ([rows, 2] int32: each row's key as low and high halves), in order."""
    cols = torch.arange(columns, dtype=torch.int32, device=keys.device).view(1, -1)
    for start in range(0, keys.shape[0], SEEDED_ROWS_PER_CHUNK):
        chunk = keys[start : start + SEEDED_ROWS_PER_CHUNK]
        bits = _fmix32(_fmix32(cols ^ chunk[:, :1]) ^ chunk[:, 1:])
        # The top 23 bits, centred: in (0, 1) and exact in float32 (24 significant bits).
        yield start, (_shr32(bits, 9).float() + 0.5).mul_(1.0 / (1 << 23))


def fill_seeded_noise(
    noise: torch.Tensor,  # [num_rows, vocab] float32, the seeded rows written
    seeded: torch.Tensor,  # [s, 3] int32: a row of noise, its key's low half, its key's high half
    uniform: torch.Tensor | None = None,  # [num_rows] float32, the seeded rows written
) -> None:
    """noise[row_i, c] = -log(u(key_i, c)); uniform[row_i] = u(key_i, vocab), the column after."""
    vocab = noise.shape[1]
    columns = vocab + (uniform is not None)
    rows = seeded[:, 0].long()
    for start, u in seeded_uniform_chunks(seeded[:, 1:], columns):
        at = rows[start : start + len(u)]
        if uniform is not None:
            uniform[at] = u[:, vocab]
        noise[at] = u[:, :vocab].log_().neg_()
