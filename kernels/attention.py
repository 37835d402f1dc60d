"""Paged attention over the block-table KV cache, for mixed decode and chunked-prefill batches.

Layouts are those of `reference.paged_attention`: the query tokens of sequence `s` are
`q[query_start_loc[s]:query_start_loc[s + 1]]`, the last tokens of a context of `seq_lens[s]`
tokens whose K/V live in the cache blocks `block_tables[s]`; attention is causal.

Two paths, each launched over the whole batch; a program whose row is the other kind exits at once,
so no host code inspects the batch (no `.item()`, CUDA-graph safe):

- Decode rows (one query token): flash-decoding. `_decode_kernel` runs one program per
  (sequence, kv head, context split). The host picks only the split count, from the batch size and
  the SM count; each program cuts its own sequence's context into partitions of
  `max(min_partition, roundup(cdiv(ctx_len, num_splits), TILE_N))` tokens (`_partition`), so a
  short context uses few splits and the programs past its end exit at once. This keeps decode
  parallel inside CUDA graphs, where `max_seq_len` is the model's whole context length and says
  nothing about the batch. The GROUP query heads that share a kv head are the rows of one `tl.dot`
  (padded to 16 rows), so each K/V tile is read from memory once for the whole group. Each split
  keeps an online softmax (running max `m`, running sum `l`, accumulator `acc`) over its
  TILE_N-token tiles and writes `acc / l` and `m + log2(l)`; `_reduce_kernel` finds the same
  partition and merges the splits by their log-sum-exp. A sequence whose context fits one
  partition (every sequence when num_splits == 1) is written by the decode kernel directly. Over a
  cache that holds no NaN or inf in any slot (the engine's fp8 cache: zeroed, written finite by
  `kv_cache`), a context's last tile is read whole in the same pipelined loop, only its scores masked
  (`DecodeConfig.finite_cache`); otherwise it is loaded masked after the loop.
- Prefill rows (more than one query token): `_prefill_kernel` runs one program per
  (BLOCK_Q query tokens, kv head), the BLOCK_Q x GROUP (token, head) pairs being the BLOCK_M rows of
  the tile, FlashAttention-2 style. Tiles entirely below the first row's position need no causal
  mask; only the last few are masked. Programs map to (sequence, query block) by a binary search
  over `query_start_loc // BLOCK_Q + s`, which bounds the grid by `num_tokens // BLOCK_Q + num_seqs`.

An fp8 (e4m3) cache holds K / k_scale and V / v_scale: each tile is widened as it is loaded
(exactly) to float16, q and the probabilities with it (`_dot_dtype`); k_scale is folded into the score
scale and v_scale into the output's normalizer, so the loop is the same and reads half the bytes.

K tiles (and slot-major V tiles) are gathered token by token through the block table
(`pos // block_size` picks the block, `pos % block_size` the slot), so a tile may span several cache
blocks and any block size works. The engine keeps an fp8 V cache token-major (`kv_cache.cache_view`):
its tiles are read in runs of min(block_size, tile) contiguous slots (`_load_v_token_major`), so
block size and tile must divide one another; a slot-major fp8 V tile is widened by inline PTX in
decode (`_widen_fp8`). Scores are kept in base 2 (`exp2`, with log2(e) folded into the scale).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace
from typing import Literal, cast

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.kv_cache import is_token_major
from pagoda.kernels.pdl import await_inputs
from pagoda.kernels.quant import INTERPRETED


@triton.jit
def _load_kv_tile(
    cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_row,  # [max_blocks_per_seq] of this sequence
    pos,  # [TILE_N] token positions in the context
    dims,  # [HEAD_DIM]
    kv_head,
    stride_block,
    stride_slot,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    MASK: tl.constexpr,
    pos_ok,  # [TILE_N] which positions exist (used when MASK)
    MASK_DATA: tl.constexpr = True,  # with MASK: False reads the slots past the end as they are (block 0's
    # where the block table has no entry): a finite cache's (`DecodeConfig.finite_cache`)
):
    if MASK:
        block_ids = tl.load(block_table_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        offs = block_ids * stride_block + (pos % BLOCK_SIZE) * stride_slot + kv_head * stride_head
        if MASK_DATA:
            tile = tl.load(cache_ptr + offs[:, None] + dims[None, :], mask=pos_ok[:, None], other=0.0)
        else:
            tile = tl.load(cache_ptr + offs[:, None] + dims[None, :])
    else:
        block_ids = tl.load(block_table_row + pos // BLOCK_SIZE).to(tl.int64)
        offs = block_ids * stride_block + (pos % BLOCK_SIZE) * stride_slot + kv_head * stride_head
        tile = tl.load(cache_ptr + offs[:, None] + dims[None, :])
    return tile  # [TILE_N, HEAD_DIM]


@triton.jit
def _load_v_token_major(
    cache_ptr,  # token-major (`kv_cache.cache_view`): [num_blocks, num_kv_heads, head_dim, block_size]
    block_table_row,  # [max_blocks_per_seq] of this sequence
    tile_start,  # the tile's first position, a multiple of SUB
    end,  # positions from here on are zeros (MASK)
    dims,  # [HEAD_DIM]
    kv_head,
    stride_block,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SUB: tl.constexpr,  # min(BLOCK_SIZE, TILE_N): the slots of one block a tile holds in a row
    HEAD_DIM: tl.constexpr,
    MASK: tl.constexpr,
):
    """A V tile [TILE_N, HEAD_DIM] from a token-major cache, read as TILE_N // SUB runs of SUB
    contiguous slots per dim: memory contiguous along the P @ V dot's reduction, as K is for Q @ K^T, so
    an 8-bit tile reaches the dot the way K does (a plain cast), not byte by byte. The runs are loaded
    whole (vectorized); with MASK, positions at or past `end` are zeroed after the load, never left to
    the probabilities, since an unwritten slot of a cache not known to be finite may hold a NaN's bits
    (over the engine's fp8 cache, `DecodeConfig.finite_cache`, the decode kernel passes no MASK)."""
    runs = tile_start + tl.arange(0, TILE_N // SUB) * SUB  # [NUM_RUNS] each run's first position
    slots = tl.arange(0, SUB)
    block_ids = tl.load(block_table_row + runs // BLOCK_SIZE, mask=runs < end, other=0).to(tl.int64)
    first_slot = tl.multiple_of(runs % BLOCK_SIZE, SUB)
    offs = (
        (block_ids * stride_block + first_slot + kv_head * stride_head)[:, None, None]
        + slots[None, :, None]
        + dims[None, None, :] * BLOCK_SIZE
    )
    tile = tl.load(cache_ptr + offs)  # [NUM_RUNS, SUB, HEAD_DIM], contiguous along SUB
    if MASK:
        pos_ok = (runs[:, None] + slots[None, :]) < end  # [NUM_RUNS, SUB]
        tile = tl.where(pos_ok[:, :, None], tile, tl.zeros_like(tile))
    return tile.reshape(TILE_N, HEAD_DIM)


@triton.jit
def _widen_fp8(tile, DOT_DTYPE: tl.constexpr, ASM: tl.constexpr):
    """An fp8 cache tile widened to DOT_DTYPE (a 16-bit tile is only cast).

    ASM: e4m3 -> float16 by the hardware conversion in inline PTX, marked impure so that Triton keeps it
    where it stands, in the load's layout: the tile then reaches the dot as float16 through shared
    memory (`ldmatrix.trans` for V). A cast, and a pure asm alike, are moved past that trip, and the V
    operand (contiguous along the dot's N, not its K) is then read back from shared memory a byte at a
    time (`ld.shared.b8`, seen in the sm_90 PTX): V widened that way ran at 0.4-0.6 of copy bandwidth
    where K reached 0.8-1.0 (H200, `python -m pagoda.bench.kernels --sweep fp8`). The interpreter
    cannot run PTX (`_COMPILED`).
    """
    if ASM:
        return tl.inline_asm_elementwise(
            "cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [tile.to(tl.uint8, bitcast=True)],
            dtype=tl.float16, is_pure=False, pack=2,
        )  # fmt: skip
    return tile.to(DOT_DTYPE)


@triton.jit
def _partition(ctx_len, num_splits, min_partition, TILE_N: tl.constexpr):
    """Context tokens per split of one sequence: at most num_splits splits, none under min_partition."""
    return tl.maximum(min_partition, tl.cdiv(tl.cdiv(ctx_len, num_splits), TILE_N) * TILE_N)


@triton.jit
def _decode_tile(
    q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_row, tile_start, end, dims, kv_head,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale_log2,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr, V_ASM: tl.constexpr, V_SUB: tl.constexpr, MASK: tl.constexpr,
    FINITE: tl.constexpr,
):  # fmt: skip
    """One TILE_N-token tile of a decode split's online softmax: (m_i, l_i, acc) after it. MASK: the
    tile may run past `end`. FINITE: the cache holds no NaN or inf, written or not, so a masked tile
    masks only its block-table reads and its scores: K and V past `end` are read as they are (their
    probabilities are 0, and 0 times a finite value adds nothing)."""
    pos = tile_start + tl.arange(0, TILE_N)
    pos_ok = pos < end
    k = _load_kv_tile(
        k_cache_ptr, block_table_row, pos, dims, kv_head, stride_kb, stride_ks, stride_kh,
        BLOCK_SIZE, MASK, pos_ok, not FINITE,
    ).to(DOT_DTYPE)  # fmt: skip
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if MASK:
        s = tl.where(pos_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_SUB:
        v = _load_v_token_major(
            v_cache_ptr, block_table_row, tile_start, end, dims, kv_head, stride_vb, stride_vh,
            BLOCK_SIZE, TILE_N, V_SUB, HEAD_DIM, MASK and not FINITE,
        ).to(DOT_DTYPE)  # fmt: skip
    else:
        v = _load_kv_tile(
            v_cache_ptr, block_table_row, pos, dims, kv_head, stride_vb, stride_vs, stride_vh,
            BLOCK_SIZE, MASK, pos_ok, not FINITE,
        )  # fmt: skip
        v = _widen_fp8(v, DOT_DTYPE, V_ASM)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# The block table's row stride is its widest row in an eager step (step to step: 1, a multiple of 16 or
# neither) and max_model_len's blocks + 1 in a CUDA graph: it only offsets a row, and specialized it
# would multiply the variants `compile_decode_variants` compiles by three. num_splits stays specialized:
# those variants are compiled before the first request.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # [num_seqs]
    query_start_loc_ptr,  # [num_seqs + 1]
    out_ptr,  # [num_tokens, num_heads, head_dim], written here when the context fits one split
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32, each split's acc / l
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] float32, each split's m + log2(l)
    scale_log2,  # softmax scale x log2(e) x k_scale
    v_scale,
    min_partition,  # the fewest context tokens per split, a multiple of TILE_N
    num_splits,  # a runtime value, not a constexpr: one compiled kernel serves every split count
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # q's dtype, or float16 over an fp8 cache (see _dot_dtype)
    V_ASM: tl.constexpr,  # widen the V tile by inline PTX (`_widen_fp8`); K is cast
    V_SUB: tl.constexpr,  # 0: V slot-major; else token-major: min(BLOCK_SIZE, TILE_N) (`_load_v_token_major`)
    FINITE: tl.constexpr,  # DecodeConfig.finite_cache
    PDL: tl.constexpr,  # pdl.flags: launched early, waits in await_inputs
):
    await_inputs(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx_len = tl.load(seq_lens_ptr + seq)
    partition = _partition(ctx_len, num_splits, min_partition, TILE_N)
    start = split * partition
    if (q_len != 1) | (start >= ctx_len):
        return
    end = tl.minimum(start + partition, ctx_len)

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    q_ptrs = q_ptr + q_start.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)  # [BLOCK_M, HEAD_DIM]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # The loop runs the whole tiles unmasked, then the one running past `end`, if any, is loaded masked
    # after it (a masked token-major V tile takes a slower path to the dot, `_load_v_token_major`); over a
    # finite cache the loop runs to `end`, every tile masked as `_decode_tile` masks then: pipelined to it.
    loop_end = start + (end - start) // TILE_N * TILE_N
    if FINITE:
        loop_end = end
    for tile_start in range(start, loop_end, TILE_N):
        m_i, l_i, acc = _decode_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_row, tile_start, end, dims, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale_log2,
            BLOCK_SIZE, TILE_N, HEAD_DIM, DOT_PRECISION, DOT_DTYPE, V_ASM, V_SUB, FINITE, FINITE,
        )  # fmt: skip
    if not FINITE:  # noqa: SIM102 (apart: a constexpr test, so the finite kernel holds no tail code)
        if loop_end < end:
            m_i, l_i, acc = _decode_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_row, loop_end, end, dims, kv_head,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, scale_log2,
                BLOCK_SIZE, TILE_N, HEAD_DIM, DOT_PRECISION, DOT_DTYPE, V_ASM, V_SUB, True, False,
            )  # fmt: skip

    out = acc * (v_scale / l_i)[:, None]
    if partition >= ctx_len:  # the only split of this sequence: nothing to merge
        o_ptrs = out_ptr + q_start.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        num_heads = GROUP * tl.num_programs(1)
        part = (seq.to(tl.int64) * num_heads + heads) * num_splits + split  # [BLOCK_M]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=row_ok[:, None])
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _reduce_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] float32
    seq_lens_ptr,  # [num_seqs]
    query_start_loc_ptr,  # [num_seqs + 1]
    min_partition,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # num_splits rounded up to a power of two
    PDL: tl.constexpr,  # pdl.flags: launched early, waits in await_inputs
):
    await_inputs(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx_len = tl.load(seq_lens_ptr + seq)
    # At most num_splits: the partition holds at least cdiv(ctx_len, num_splits) tokens.
    num_used = tl.cdiv(ctx_len, _partition(ctx_len, num_splits, min_partition, TILE_N))
    if (q_len != 1) | (num_used == 1):  # a single split wrote the output itself
        return
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_used
    dims = tl.arange(0, HEAD_DIM)
    part = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part, mask=split_ok, other=float("-inf"))
    weight = tl.where(split_ok, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    parts = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=split_ok[:, None], other=0.0
    )
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    o_ptrs = out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + dims
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


# Triton specializes integer arguments on being 1 or a multiple of 16: one compile per combination.
# The batch's sequence count and its block table's row stride change from step to step, so a served
# step could meet a new combination and compile mid-traffic (an H200 engine start-up compiled this
# kernel 7 times, and once more in its first ragged batch; BENCHMARKS.md 2026-12-02). Both only bound a
# search and offset a row: nothing to gain from specializing them. Untimed on a GPU.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # [num_seqs]
    query_start_loc_ptr,  # [num_seqs + 1]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    scale_log2,  # softmax scale x log2(e) x k_scale
    v_scale,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # q's dtype, or float16 over an fp8 cache (see _dot_dtype)
    V_SUB: tl.constexpr,  # as in _decode_kernel
    PDL: tl.constexpr,  # pdl.flags: launched early, waits in await_inputs
):
    await_inputs(PDL)
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    # Last query blocks first: under the causal mask they see the most keys, so the long programs
    # start in the first wave and the short ones fill the tail.
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    # The sequence owning this query block: the last s with query_start_loc[s] // BLOCK_Q + s <= q_block.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = (q_block - q_start // BLOCK_Q - seq) * BLOCK_Q  # first query index of the block
    if (q_len <= 1) | (first >= q_len):
        return
    ctx_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    tok = first + rows // GROUP_PAD
    group_idx = rows % GROUP_PAD
    row_ok = (tok < q_len) & (group_idx < GROUP)
    heads = kv_head * GROUP + group_idx
    q_ptrs = (
        q_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)  # [BLOCK_M, HEAD_DIM]
    q_pos = ctx_len - q_len + tok  # position of each row's token in the context

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, TILE_N)
    # Tiles below `unmasked_end` are visible to every row; the rest are masked.
    unmasked_end = (ctx_len - q_len + first + 1) // TILE_N * TILE_N
    kv_end = ctx_len - q_len + tl.minimum(first + BLOCK_Q, q_len)
    for tile_start in range(0, unmasked_end, TILE_N):
        pos = tile_start + offs_n
        k = _load_kv_tile(
            k_cache_ptr, block_table_row, pos, dims, kv_head, stride_kb, stride_ks, stride_kh,
            BLOCK_SIZE, False, pos,
        ).to(q.dtype)  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_SUB:
            v = _load_v_token_major(
                v_cache_ptr, block_table_row, tile_start, kv_end, dims, kv_head, stride_vb, stride_vh,
                BLOCK_SIZE, TILE_N, V_SUB, HEAD_DIM, False,
            ).to(q.dtype)  # fmt: skip
        else:
            v = _load_kv_tile(
                v_cache_ptr, block_table_row, pos, dims, kv_head, stride_vb, stride_vs, stride_vh,
                BLOCK_SIZE, False, pos,
            ).to(q.dtype)  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    for tile_start in range(unmasked_end, kv_end, TILE_N):
        pos = tile_start + offs_n
        pos_ok = pos < kv_end
        k = _load_kv_tile(
            k_cache_ptr, block_table_row, pos, dims, kv_head, stride_kb, stride_ks, stride_kh,
            BLOCK_SIZE, True, pos_ok,
        ).to(q.dtype)  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_SUB:
            v = _load_v_token_major(
                v_cache_ptr, block_table_row, tile_start, kv_end, dims, kv_head, stride_vb, stride_vh,
                BLOCK_SIZE, TILE_N, V_SUB, HEAD_DIM, True,
            ).to(q.dtype)  # fmt: skip
        else:
            v = _load_kv_tile(
                v_cache_ptr, block_table_row, pos, dims, kv_head, stride_vb, stride_vs, stride_vh,
                BLOCK_SIZE, True, pos_ok,
            ).to(q.dtype)  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc * (v_scale / l_i)[:, None]
    o_ptrs = (
        out_ptr
        + (q_start + tok).to(tl.int64)[:, None] * stride_ot
        + heads[:, None] * stride_oh
        + dims[None, :]
    )
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


_COMPILED = not INTERPRETED
_FP8_WIDEN = cast(Literal["cast", "v"], os.environ.get("PAGODA_FP8_WIDEN", "v"))


@dataclass(frozen=True)
class DecodeConfig:
    tile_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    # A register cap (ptxas' maxnreg) for the decode kernel: None lets the compiler choose (128 at tile
    # 64 over an fp8 cache, so 4 programs of 4 warps an SM). Swept, not yet a default.
    maxnreg: int | None = None
    # The cache holds no NaN or inf, in written slots or not: the engine's, zeroed at allocation and
    # written finite (`kv_cache.write_kv`, the rotary launch); the default over an fp8 cache
    # (`_default_configs`). Then a context's last, partial tile needs no masked loads, only masked
    # scores, and every tile runs in one pipelined loop (`_decode_tile`'s FINITE); False loads the last
    # tile masked after the loop, its loads waiting on nothing before them.
    # One H100, us a layer at 256x256 | 64x1024 | 640x1536 | 8x8192 | 256x200 | 640x1500 | 1024x190
    # (`bench kernels --sweep fp8`, BENCHMARKS.md 2026-12-07), fp8 token-major 64/2/4: 55.5 | 53.1 | 682 |
    # 54.0 | 52.2 | 673 | 154.3 against 56.7 | 50.3 | 707 | 58.5 | 58.7 | 708 | 185.9 masked; bf16 within
    # 1-2% but for 64x1024 (98.9 / 90.4) and 8x8192 (93.9 / 107.0). 128 / 128 x 1,024: +2.6%. Compiled for
    # sm_90a (Triton 3.9's ptxas here), the fp8 kernel takes 96 registers read whole, 128 masked.
    finite_cache: bool = False
    # Split the context until the grid is about one full wave: at 115 registers x 128 threads an
    # H200 SM holds 4 programs. Measured at Llama-3-8B shapes with the old host-chosen partition
    # (cut from max_seq_len, here the batch's longest context): batch 64 (512 programs) runs 66 us
    # unsplit at 1k context and 80 us split 3 ways; batch 8 at 8k runs 238 us unsplit, 69 us split 8
    # ways (512 programs), 82 us 5 ways.
    programs_per_sm: int = 4
    # The fewest context tokens per split (rounded up to tile_n); each split also writes, and the
    # reduce reads back, GROUP x head_dim float32 (2 KB at Llama-3-8B). Timed on an H200
    # (`bench --sweep splits`, us): batch 1 x 1.1k context 7.6 at 64, 8.0-8.4 at 128, 10.9-11.7 at
    # 256, and 32 us with the old host partition at max_seq_len 128k; batch 1 x 4k 9.7 / 10.9 / 13.4;
    # batch 4 x 1k 9.3 / 10.4 / 12.9; from batch 8 x 4k and 16 x 1k up all three tie. The splits
    # merged in the decode kernel by the last to finish (an atomic counter) instead of the reduce launch
    # were tried, us vs the launch: batch 1 x 1.1k 10.2 vs 7.4, 1 x 4k 23.8 vs 9.6, 16 x 1k 24.2 vs 25.7;
    # the engine's decode + reduce at batch 1 (fp8) 360 us a step vs 267. Slower where it was to help.
    min_partition: int = 64
    num_splits: int | None = None  # fixed split count (tests, sweeps); None picks one
    # "max_seq_len" is the old scheme, kept to time against: one partition for the whole batch, cut
    # from max_seq_len on the host. Inside CUDA graphs max_seq_len is max_model_len, so it ran a
    # batch-1 decode at 1.1k context in one split per kv head (8 programs, ~10 us per layer).
    partition_by: Literal["seq_len", "max_seq_len"] = "seq_len"
    # Over a token-major V the masked last tile is slower (a select in registers before the dot). Taking
    # the part past the last whole tile by unmasked 16-token runs instead was tried (c2993b2): the engine's
    # fp8 + fp8 KV decode step at batch 256 (128-256-token contexts, H200) went 6.39 -> 6.58 ms busy.
    # Over an fp8 cache: "float16" widens the tiles (and q) to float16 for the dots, "q" to q's dtype.
    fp8_dot: Literal["float16", "q"] = "float16"
    # How float16 dots widen fp8 tiles: "v" widens V by inline PTX (`_widen_fp8`) and casts K; "cast"
    # casts both, as "v" does in the interpreter and below compute capability 8.9. H200, us a layer at
    # 256x256 | 64x1k | 640x1.5k | 8x8k (`python -m pagoda.bench.kernels --sweep fp8 --sweep-only`,
    # BENCHMARKS.md 2026-12-02): "v" tile 64 52.8 | 51.6 | 659 | 55.8; "cast" tile 128 70.3 | 65.4 |
    # 845 | 65.2. Dropped as slower: K by PTX too, tile 64 71.6 | 68.8 | 912 | 74.0; V loaded as 16-bit
    # words, tile 64 59.3 | 59.6 | 716 | 60.4. PAGODA_FP8_WIDEN (cast|v) sets the default. A token-major
    # V (the engine's fp8 layout) is cast either way, like K (`_load_v_token_major`).
    fp8_widen: Literal["cast", "v"] = _FP8_WIDEN

    def __post_init__(self) -> None:
        if self.min_partition < 1 or (self.num_splits is not None and self.num_splits < 1):
            raise ValueError(
                f"DecodeConfig: min_partition {self.min_partition} and num_splits {self.num_splits} "
                "must be at least 1"
            )
        if self.fp8_widen not in ("cast", "v"):
            raise ValueError(f"DecodeConfig: fp8_widen {self.fp8_widen!r} is not cast or v")
        if self.partition_by not in ("seq_len", "max_seq_len"):
            raise ValueError(
                f"DecodeConfig: partition_by {self.partition_by!r} is not seq_len or max_seq_len"
            )


@dataclass(frozen=True)
class PrefillConfig:
    # Measured at Llama-3-8B shapes (bf16, causal): 64/64/4/3 ran 425, 464 and 191 us on 1x4096,
    # 4x2048 and 16x512 tokens; 128/64/8/3 ran 463, 501 and 204 us. Two stages instead of three
    # (H200, us a layer at 32x128 | 26x128 | 8x512 | 2x2048 tokens, a scratch sweep, BENCHMARKS.md
    # 2026-12-02): bf16 cache 61.8 | 51.5 | 97.8 | 241.9 against 63.8 | 53.4 | 99.9 | 244.7; fp8 cache
    # (V token-major) 61.2 | 51.2 | 109.7 | 298.9 against 69.7 | 58.3 | 120.0 | 318.5. One stage wins the
    # 128-token prompts (56.7, 57.6 at 32x128) and loses long ones (305 at 2x2048); block_m 32 or 128,
    # tile 32 or 128 and 8 warps were slower.
    block_m: int = 64
    tile_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_CACHE = torch.float8_e4m3fn  # a cache of this dtype holds K / k_scale and V / v_scale
# The interpreter runs a program at a time: small tiles exercise the multi-tile paths in tests.
_INTERPRETER_DECODE = DecodeConfig(tile_n=16, num_warps=1, num_stages=1, programs_per_sm=16, min_partition=16)
_INTERPRETER_PREFILL = PrefillConfig(block_m=16, tile_n=16, num_warps=1, num_stages=1)


def _default_configs(
    q: torch.Tensor, k_cache: torch.Tensor, v_token_major: bool
) -> tuple[DecodeConfig, PrefillConfig]:
    decode, prefill = _default_tiles(q, k_cache, v_token_major)
    # Over an fp8 cache (the engine's never holds NaN: kv_cache) the last tile is read whole: measured
    # there (DecodeConfig.finite_cache); a 16-bit cache lost 9% at 64 x 1,024 and keeps the masked tail.
    return replace(decode, finite_cache=k_cache.dtype == FP8_CACHE), prefill


def _default_tiles(
    q: torch.Tensor, k_cache: torch.Tensor, v_token_major: bool
) -> tuple[DecodeConfig, PrefillConfig]:
    if q.device.type != "cuda":
        return _INTERPRETER_DECODE, _INTERPRETER_PREFILL
    head_dim = q.shape[2]
    if k_cache.dtype == FP8_CACHE and head_dim <= 128 and _FP8_WIDEN == "cast" and not v_token_major:
        # A slot-major V cast, not widened by PTX: twice the tokens per tile keeps as many bytes in
        # flight. H200, batch 64, us at 1k / 4k context: tile 128 65 / 248, tile 64 85 / 323 (bf16 cache,
        # tile 64: 68 / 252). By PTX, or token-major, tile 64 is the faster (BENCHMARKS.md, 2026-12-02).
        return DecodeConfig(tile_n=128), PrefillConfig()
    if q.dtype == torch.float32:  # twice the bytes per tile: halve the tiles to stay in shared memory
        return DecodeConfig(tile_n=32), PrefillConfig(block_m=64, tile_n=32, num_warps=4, num_stages=2)
    if head_dim > 128:
        return DecodeConfig(tile_n=32), PrefillConfig(block_m=64, tile_n=32, num_warps=4, num_stages=2)
    if head_dim <= 64:
        return DecodeConfig(), PrefillConfig(block_m=128, tile_n=64, num_warps=4, num_stages=3)
    return DecodeConfig(), PrefillConfig()


# Prompt chunks of at least this many tokens take `long_prefill_config`'s tiles (eager steps only: a
# mixed CUDA graph holds at most 2k tokens).
LONG_PREFILL_TOKENS = 8192


def long_prefill_config(
    device_type: str, q_dtype: torch.dtype, head_dim: int, cache_dtype: torch.dtype
) -> PrefillConfig | None:
    """Tiles for chunks of LONG_PREFILL_TOKENS or more (long prompts), where the defaults, tuned on
    128-2k-token prompts, leave 10-15% behind. One H100, an 8k-token chunk last in a 32k context,
    Llama-3-8B heads (`pagoda bench kernels --sweep long-prefill`, BENCHMARKS.md 2026-12-05): bf16 cache
    9.40 ms with 256/64/8/2 against the default's 10.47 (409 against 368 TFLOP/s); fp8 cache, V
    token-major, 10.90 ms with 128/64/4/2 against 12.52 (353 against 307). None: keep the defaults
    (other head sizes and fp32 were not measured)."""
    if device_type != "cuda" or head_dim != 128 or q_dtype not in (torch.bfloat16, torch.float16):
        return None
    if cache_dtype == FP8_CACHE:
        return PrefillConfig(block_m=128, tile_n=64, num_warps=4, num_stages=2)
    return PrefillConfig(block_m=256, tile_n=64, num_warps=8, num_stages=2)


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _dot_dtype(q: torch.Tensor, k_cache: torch.Tensor, fp8_dot: str) -> tl.dtype:
    """The dtype both dot operands are widened to: q's, except over an fp8 cache with 16-bit q, where
    float16 is: e4m3 -> float16 is one instruction on NVIDIA GPUs (bfloat16 takes a detour through
    float32), and float16's range (65504) holds attention queries and probabilities."""
    if k_cache.dtype == FP8_CACHE and q.dtype != torch.float32 and fp8_dot == "float16":
        return tl.float16
    return _TL_DTYPES[q.dtype]


@functools.cache
def _has_fp8_conversion(device: torch.device) -> bool:
    """Whether `cvt.rn.f16x2.e4m3x2` exists there: compute capability 8.9+ (Ada, Hopper). A CPU device
    is the compile check's (tests/kernels/compile_for_gpu.py, which builds for sm_90)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(
    cfg: DecodeConfig, num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int
) -> tuple[int, int]:
    """(num_splits, min_partition) for the decode kernels; each sequence's partition is then
    `_partition(ctx_len, num_splits, min_partition)` on the device.

    num_splits makes num_seqs * num_kv_heads * num_splits about one wave, and is never more than
    max_seq_len needs at min_partition tokens a split.
    """
    min_partition = triton.cdiv(cfg.min_partition, cfg.tile_n) * cfg.tile_n
    if cfg.num_splits is not None:
        num_splits = cfg.num_splits
    else:
        wanted = round(cfg.programs_per_sm * num_sms / (num_seqs * num_kv_heads))
        num_splits = max(1, min(wanted, triton.cdiv(max_seq_len, min_partition)))
    if cfg.partition_by == "max_seq_len":
        # As min_partition it is every sequence's partition: with ctx_len <= max_seq_len the device's
        # other term, roundup(cdiv(ctx_len, num_splits), tile_n), never exceeds it.
        min_partition = triton.cdiv(triton.cdiv(max_seq_len, num_splits), cfg.tile_n) * cfg.tile_n
        num_splits = triton.cdiv(max_seq_len, min_partition)
    return num_splits, min_partition


def decode_split_counts(cfg: DecodeConfig, num_kv_heads: int, max_seq_len: int, num_sms: int) -> list[int]:
    """One split count for each compiled variant of the decode and reduce kernels that contexts of up to
    `max_seq_len` tokens can launch: Triton compiles the reduce for each power-of-two SPLITS_PAD and
    specializes both kernels' `num_splits` on being 1 and on being a multiple of 16. Every count from 1
    to the most (one sequence at the longest context, `decode_splits`) is reachable."""
    most, _ = decode_splits(cfg, 1, num_kv_heads, max_seq_len, num_sms)
    first: dict[tuple[int, bool, bool], int] = {}
    for n in range(1, most + 1):
        first.setdefault((triton.next_power_of_2(n), n == 1, n % 16 == 0), n)
    return list(first.values())


def compile_decode_variants(
    q: torch.Tensor,  # [>= 1, num_heads, head_dim]: the dtype, heads and device of the model's queries
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    max_seq_len: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> list[int]:
    """Launch the decode path once for each of `decode_split_counts`, one query token over block 0
    (read only), so that Triton compiles every variant before the first request. A variant first met
    mid-traffic compiles inside some step and stalls every request in it: one reduce kernel took 67 ms
    on the H100 machine's host (BENCHMARKS.md 2026-12-07), met when whole prompts and long chunks,
    which go to cuDNN, had kept the warm-up's long prompts off the paged kernels. The counts launched."""
    decode, _ = _default_configs(q, k_cache, is_token_major(v_cache))
    counts = decode_split_counts(decode, k_cache.shape[2], max_seq_len, _num_sms(q.device))
    one = q[:1]
    blocks = torch.zeros((1, triton.cdiv(max_seq_len, k_cache.shape[1])), dtype=torch.int32, device=q.device)
    seq_lens = torch.full((1,), max_seq_len, dtype=torch.int32, device=q.device)
    starts = torch.tensor([0, 1], dtype=torch.int32, device=q.device)
    for n in counts:
        paged_attention(
            one, k_cache, v_cache, blocks, seq_lens, starts, 1.0, 1, max_seq_len,
            decode_config=replace(decode, num_splits=n), k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    return counts


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            "paged_attention: want q [num_tokens, num_heads, head_dim] and k_cache == v_cache shapes "
            f"[num_blocks, block_size, num_kv_heads, head_dim]; got q {tuple(q.shape)}, "
            f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"paged_attention: q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"paged_attention: num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}"
        )
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"paged_attention: head_dim {head_dim} must be a power of two in [16, 256]")
    if q.dtype not in _DTYPES or k_cache.dtype not in (q.dtype, FP8_CACHE) or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"paged_attention: q must be one of {_DTYPES}, k_cache and v_cache q's dtype or both "
            f"{FP8_CACHE}; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1 and not (name == "v_cache" and is_token_major(t)):
            raise ValueError(
                f"paged_attention: {name} must be contiguous in head_dim (or token-major, for v_cache: "
                f"kv_cache.cache_view), strides {t.stride()}"
            )
    for name, t, dims in (
        ("block_tables", block_tables, 2),
        ("seq_lens", seq_lens, 1),
        ("query_start_loc", query_start_loc, 1),
    ):
        if t.dim() != dims or t.dtype not in (torch.int32, torch.int64) or t.stride(-1) != 1:
            raise ValueError(
                f"paged_attention: {name} must be a {dims}-d int32 tensor contiguous in its last dim; "
                f"got {t.dtype} {tuple(t.shape)} strides {t.stride()}"
            )
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"paged_attention: {num_seqs} seq_lens want block_tables [{num_seqs}, *] and query_start_loc "
            f"[{num_seqs + 1}]; got {tuple(block_tables.shape)} and {tuple(query_start_loc.shape)}"
        )
    for name, t in (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        if t.device != q.device:
            raise ValueError(f"paged_attention: {name} is on {t.device}, q on {q.device}")


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
    *,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim], written when given
    decode_config: DecodeConfig | None = None,
    prefill_config: PrefillConfig | None = None,
    k_scale: float = 1.0,  # the cache holds K / k_scale (an fp8 cache; 1.0 otherwise)
    v_scale: float = 1.0,
    decode_rows: bool = True,  # False: no sequence has a single query token (the decode kernels are skipped)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's query tokens over its paged context (GQA aware).

    `max_query_len` and `max_seq_len` size the grids and must bound every row (they are not checked
    against the tensors: that would synchronize), as `decode_rows` must be true where any sequence has a
    single query token: the decode kernel attends those rows (its programs for the others exit at once,
    but its launch and the reduce's cost the host ~20-40 us of Python each). `out` serves static buffers
    (CUDA graphs) and poisoned-output checks; the configs are for tests and benchmarks.
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(
            f"paged_attention: out must be like q {q.dtype} {tuple(q.shape)}, contiguous in head_dim"
        )
    if num_tokens == 0 or num_seqs == 0 or max_seq_len <= 0:
        return out
    token_major = is_token_major(v_cache)
    default_decode, default_prefill = _default_configs(q, k_cache, token_major)
    dcfg = decode_config or default_decode
    pcfg = prefill_config or default_prefill
    if prefill_config is None and max_query_len >= LONG_PREFILL_TOKENS:
        pcfg = long_prefill_config(q.device.type, q.dtype, head_dim, k_cache.dtype) or pcfg
    if token_major and any(block_size % t and t % block_size for t in (dcfg.tile_n, pcfg.tile_n)):
        raise ValueError(
            f"paged_attention: a token-major v_cache is read in runs of min(block_size, tile) slots: "
            f"block_size {block_size} and tiles {dcfg.tile_n} / {pcfg.tile_n} must divide one another"
        )
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"paged_attention: k_scale {k_scale} and v_scale {v_scale} must be positive")
    scale_log2 = scale * math.log2(math.e) * k_scale
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    strides = (
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
    )  # fmt: skip

    dot_dtype = _dot_dtype(q, k_cache, dcfg.fp8_dot)
    v_asm = (
        not token_major
        and _COMPILED
        and k_cache.dtype == FP8_CACHE
        and dot_dtype == tl.float16
        and dcfg.fp8_widen == "v"
        and _has_fp8_conversion(q.device)
    )
    v_sub = min(block_size, dcfg.tile_n) if token_major else 0
    if decode_rows:  # the split decode kernel, then the merge of its splits
        num_splits, min_partition = decode_splits(
            dcfg, num_seqs, num_kv_heads, max_seq_len, _num_sms(q.device)
        )
        if num_splits > 1:
            part_out = torch.empty(
                (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
            )
            part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        else:
            part_out = part_lse = out  # unused
        _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, part_out, part_lse,
            scale_log2, float(v_scale), min_partition, num_splits, *strides, out.stride(0), out.stride(1),
            GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size, TILE_N=dcfg.tile_n, DOT_PRECISION=precision,
            DOT_DTYPE=dot_dtype, V_ASM=v_asm, V_SUB=v_sub, FINITE=dcfg.finite_cache,
            num_warps=dcfg.num_warps, num_stages=dcfg.num_stages, **pdl.flags(q),
            **({"maxnreg": dcfg.maxnreg} if dcfg.maxnreg else {}),
        )  # fmt: skip
        if num_splits > 1:
            _reduce_kernel[(num_seqs, num_heads)](
                out, part_out, part_lse, seq_lens, query_start_loc, min_partition, num_splits,
                out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, TILE_N=dcfg.tile_n, SPLITS_PAD=triton.next_power_of_2(num_splits),
                **pdl.flags(q),
            )  # fmt: skip

    if max_query_len > 1:
        group_pad = triton.next_power_of_2(group)
        block_q = max(1, pcfg.block_m // group_pad)
        _prefill_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, scale_log2, float(v_scale),
            num_seqs,
            *strides, out.stride(0), out.stride(1),
            GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
            TILE_N=pcfg.tile_n, DOT_PRECISION=precision, DOT_DTYPE=_dot_dtype(q, k_cache, "float16"),
            V_SUB=min(block_size, pcfg.tile_n) if token_major else 0,
            num_warps=pcfg.num_warps, num_stages=pcfg.num_stages, **pdl.flags(q),
        )  # fmt: skip
    return out
