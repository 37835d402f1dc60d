"""Batched multi-LoRA: each token's adapter delta `y += B_slot (A_slot x)`, many adapters in one launch.

An engine step serves tokens of different adapters at once, each adapter in a GPU slot
(`reference.py` documents the layouts). The update is two skinny products through the rank R (16-64,
against K and N in the thousands): the shrink `v = A x` to `[S, T, R]` float32, then the expand
`y += B v`, both for the S slices of a merged projection at once. Both are bound by memory (x and y
once each, the slots' A and B from L2), so each kernel reads its activations once and stays in one
launch for every adapter and every slice.

Punica (Chen et al., 2023; S-LoRA uses its kernels) names the two forms kept here:

- BGMV, batched gather matrix-vector (`segments` None): one program per token (and per output tile
  and slice) gathers its slot's matrix and does a GEMV. It is the decode form: one token a sequence,
  any mix of slots, and a grid from tensor shapes alone, so a CUDA graph captures it (no host syncs,
  a slot of -1 returns at once: graph padding and tokens without an adapter cost nothing).
- SGMV, segmented gather matrix-vector (`LoraSegments`): the tokens come in runs that share a slot (a
  prefill's sequences), so a program takes up to BLOCK_T tokens of one run and multiplies them with
  `tl.dot` on tensor cores ([BLOCK_T, BLOCK_K] x [BLOCK_K, S x R] for the shrink, [BLOCK_T, R] x
  [R, BLOCK_N] for the expand): each slot's A and B tile is read once a tile of tokens, not once a
  token. The grid is runs x ceil(max_len / BLOCK_T), so a host-known max_len sizes it; the programs past
  a shorter run's end return at once (a step of many one-token runs beside one long run launches mostly
  such programs: its decode tokens are BGMV's work).

The shrink computes all S slices in one program (A's slices are contiguous in a slot: an [S x R, K]
matrix, padded to a power of two of at least 16 rows, as `tl.dot` needs), so x is read once. It splits
K over a grid axis until about `programs_per_sm` programs an SM run, adding the partial sums with float32
atomics into a zeroed v (a decode of one token would otherwise be 1 program reading all of A; the atomics'
order makes v's last bits vary from run to run, `programs_per_sm=0` never splits). The
expand has a grid axis over slices whose programs past a shorter slice's columns return, and adds its
float32 sum to y's value once, rounded to y's dtype: as `reference.lora_expand`.

Dot precisions: the shrink multiplies x's dtype (float32 as IEEE); the expand widens B to float32 and
multiplies in TF32 for 16-bit B (exact on B, whose 8 or 11 significant bits fit TF32's 11; v keeps 11 bits
of its float32), IEEE for float32. The interpreter's `tl.dot` has no bfloat16 (numpy), so there the
shrink widens bfloat16 tiles to float32 first: the same exact products, summed in float32 as on the GPU.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pagoda.kernels import LoraSegments
from pagoda.kernels.quant import INTERPRETED


@dataclass(frozen=True)
class LoraConfig:
    """Tiles of the four kernels; untuned defaults (`pagoda bench kernels` times the LoRA rows)."""

    block_t: int = 64  # SGMV: tokens of a run per program
    block_n: int = 128  # SGMV expand: output columns per program
    block_k: int = 64  # SGMV shrink: input columns per step
    # BGMV: elements of a program's tile of A ([S x R, BLOCK_K]) or B ([BLOCK_N, R]), at least 16 columns
    # or rows: 4096 is 32 float32 registers a thread at 4 warps (BLOCK_K 64 at qkv's S x R = 3 x 16).
    gemv_tile: int = 4096
    programs_per_sm: int = 2  # the shrink splits K until about this many programs an SM (0: never)
    num_warps: int = 4


# The interpreter runs one program at a time: small tiles make tiny test shapes cover many tiles.
_INTERPRETER = LoraConfig(block_t=16, block_n=16, block_k=16, gemv_tile=256, programs_per_sm=4, num_warps=1)


@triton.jit
def _slice_bounds(slice_starts, s, NUM_SLICES: tl.constexpr):
    """Slice s's columns `slice_starts[s]:slice_starts[s + 1]` (a tuple of ints, indexed statically)."""
    lo = 0
    hi = 0
    for i in tl.static_range(NUM_SLICES):
        lo = tl.where(s == i, slice_starts[i], lo)
        hi = tl.where(s == i, slice_starts[i + 1], hi)
    return lo, hi


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [num_slots, S, R, K]
    token_slots_ptr,  # [T] int32
    v_ptr,  # [S, T, R] float32, zeroed
    K,
    R,
    k_per_split,  # input columns per program of the split axis, a multiple of BLOCK_K
    stride_x,
    stride_a_slot,
    stride_a_slice,
    stride_a_rank,
    stride_v_slice,
    stride_v_token,
    NUM_SLICES: tl.constexpr,
    R_POW2: tl.constexpr,
    SR_POW2: tl.constexpr,  # next power of two of NUM_SLICES * R_POW2
    BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr,  # K is split over programs: add the partial sums
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    j = tl.arange(0, SR_POW2)  # row j of the slot's [S x R, K] A: slice j // R_POW2, rank j % R_POW2
    s = j // R_POW2
    r = j % R_POW2
    row_ok = (s < NUM_SLICES) & (r < R)
    a_rows = a_ptr + slot * stride_a_slot + s * stride_a_slice + r * stride_a_rank
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([SR_POW2], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_end
        xk = tl.load(x_ptr + t * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
        ak = tl.load(a_rows[:, None] + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(ak.to(tl.float32) * xk[None, :], axis=1)
    out = v_ptr + s * stride_v_slice + t * stride_v_token + r
    if ATOMIC:
        tl.atomic_add(out, acc, mask=row_ok, sem="relaxed")
    else:
        tl.store(out, acc, mask=row_ok)


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [num_slots, S, R, K]
    starts_ptr,  # [G + 1] int32, token offsets of the runs
    slots_ptr,  # [G] int32
    v_ptr,  # [S, T, R] float32, zeroed
    K,
    R,
    k_per_split,
    num_t_tiles,  # ceil(max_len / BLOCK_T): programs of axis 0 per run
    stride_x,
    stride_a_slot,
    stride_a_slice,
    stride_a_rank,
    stride_v_slice,
    stride_v_token,
    NUM_SLICES: tl.constexpr,
    R_POW2: tl.constexpr,
    SR_POW2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # x's, or float32 where the interpreter has no bfloat16 dot
):
    run = tl.program_id(0) // num_t_tiles
    slot = tl.load(slots_ptr + run).to(tl.int64)
    t0 = tl.load(starts_ptr + run) + (tl.program_id(0) % num_t_tiles) * BLOCK_T
    end = tl.load(starts_ptr + run + 1)
    if slot < 0 or t0 >= end:
        return
    rows = t0 + tl.arange(0, BLOCK_T)
    row_ok = rows < end
    rows = rows.to(tl.int64)
    j = tl.arange(0, SR_POW2)
    s = j // R_POW2
    r = j % R_POW2
    col_ok = (s < NUM_SLICES) & (r < R)
    a_cols = a_ptr + slot * stride_a_slot + s * stride_a_slice + r * stride_a_rank
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_T, SR_POW2], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_end
        xt = tl.load(
            x_ptr + rows[:, None] * stride_x + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        at = tl.load(a_cols[None, :] + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(xt.to(DOT_DTYPE), at.to(DOT_DTYPE), input_precision="ieee")
    out = v_ptr + s[None, :] * stride_v_slice + rows[:, None] * stride_v_token + r[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if ATOMIC:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")
    else:
        tl.store(out, acc, mask=mask)


@triton.jit
def _bgmv_expand_kernel(
    v_ptr,  # [S, T, R] float32
    b_ptr,  # [num_slots, N, R]
    token_slots_ptr,  # [T] int32
    y_ptr,  # [T, N]
    slice_starts,  # S + 1 ints
    R,
    stride_v_slice,
    stride_v_token,
    stride_b_slot,
    stride_b_n,
    stride_y,
    NUM_SLICES: tl.constexpr,
    R_POW2: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slots_ptr + t).to(tl.int64)
    s = tl.program_id(2)
    lo, hi = _slice_bounds(slice_starts, s, NUM_SLICES)
    n0 = lo + tl.program_id(1) * BLOCK_N
    if slot < 0 or n0 >= hi:
        return
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < hi
    r = tl.arange(0, R_POW2)
    r_ok = r < R
    vr = tl.load(v_ptr + s * stride_v_slice + t * stride_v_token + r, mask=r_ok, other=0.0)
    bt = tl.load(
        b_ptr + slot * stride_b_slot + n[:, None].to(tl.int64) * stride_b_n + r[None, :],
        mask=n_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    acc = tl.sum(bt.to(tl.float32) * vr[None, :], axis=1)
    y_ptrs = y_ptr + t * stride_y + n
    y = tl.load(y_ptrs, mask=n_ok, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=n_ok)


@triton.jit
def _sgmv_expand_kernel(
    v_ptr,  # [S, T, R] float32
    b_ptr,  # [num_slots, N, R]
    starts_ptr,  # [G + 1] int32
    slots_ptr,  # [G] int32
    y_ptr,  # [T, N]
    slice_starts,  # S + 1 ints
    R,
    num_t_tiles,
    stride_v_slice,
    stride_v_token,
    stride_b_slot,
    stride_b_n,
    stride_y,
    NUM_SLICES: tl.constexpr,
    R_POW2: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "tf32" for 16-bit B (exact on B), "ieee" for float32
):
    run = tl.program_id(0) // num_t_tiles
    slot = tl.load(slots_ptr + run).to(tl.int64)
    t0 = tl.load(starts_ptr + run) + (tl.program_id(0) % num_t_tiles) * BLOCK_T
    end = tl.load(starts_ptr + run + 1)
    s = tl.program_id(2)
    lo, hi = _slice_bounds(slice_starts, s, NUM_SLICES)
    n0 = lo + tl.program_id(1) * BLOCK_N
    if slot < 0 or t0 >= end or n0 >= hi:
        return
    rows = t0 + tl.arange(0, BLOCK_T)
    row_ok = rows < end
    rows = rows.to(tl.int64)
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < hi
    r = tl.arange(0, R_POW2)
    r_ok = r < R
    vt = tl.load(
        v_ptr + s * stride_v_slice + rows[:, None] * stride_v_token + r[None, :],
        mask=row_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    bt = tl.load(
        b_ptr + slot * stride_b_slot + n[None, :].to(tl.int64) * stride_b_n + r[:, None],
        mask=r_ok[:, None] & n_ok[None, :],
        other=0.0,
    )
    acc = tl.dot(vt, bt.to(tl.float32), input_precision=DOT_PRECISION)
    y_ptrs = y_ptr + rows[:, None] * stride_y + n[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _config(config: LoraConfig | None, device: torch.device) -> LoraConfig:
    return config or (LoraConfig() if device.type == "cuda" else _INTERPRETER)


def _rank_pow2(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))  # tl.dot's smallest dimension


def _check_inputs(
    name: str, tensors: tuple[torch.Tensor, ...], token_slots: torch.Tensor, segments: LoraSegments | None
) -> None:
    """Every tensor on the first's device, token_slots one int32 a token, segments of int32 runs."""
    num_tokens = tensors[0].shape[0]
    runs = () if segments is None else (segments.starts, segments.slots)
    devices = {t.device for t in (*tensors, token_slots, *runs)}
    if len(devices) > 1:
        raise ValueError(f"{name}: every tensor must be on one device; got {sorted(map(str, devices))}")
    if token_slots.shape != (num_tokens,) or token_slots.dtype != torch.int32:
        raise ValueError(
            f"{name}: token_slots must be int32 [{num_tokens}]; got {token_slots.dtype} "
            f"{tuple(token_slots.shape)}"
        )
    if segments is None:
        return
    num_runs = segments.slots.shape[0]
    if (
        segments.slots.dim() != 1
        or segments.starts.shape != (num_runs + 1,)
        or segments.slots.dtype != torch.int32
        or segments.starts.dtype != torch.int32
        or segments.max_len < 0
    ):
        raise ValueError(
            f"{name}: segments want int32 starts [G + 1] and slots [G] and max_len >= 0; got starts "
            f"{segments.starts.dtype} {tuple(segments.starts.shape)}, slots {segments.slots.dtype} "
            f"{tuple(segments.slots.shape)}, max_len {segments.max_len}"
        )


def _split_k(num_programs: int, k: int, cfg: LoraConfig, device: torch.device) -> tuple[int, int]:
    """(splits, input columns per split): split K until about `programs_per_sm` programs an SM run."""
    num_chunks = triton.cdiv(k, cfg.block_k)
    splits = max(
        1, min(num_chunks, triton.cdiv(cfg.programs_per_sm * _num_sms(device), max(1, num_programs)))
    )
    chunks_per_split = triton.cdiv(num_chunks, splits)
    return triton.cdiv(num_chunks, chunks_per_split), chunks_per_split * cfg.block_k


def lora_shrink(
    x: torch.Tensor,  # [T, K]
    a: torch.Tensor,  # [num_slots, S, R, K] in x's dtype
    token_slots: torch.Tensor,  # [T] int32, -1: no adapter
    segments: LoraSegments | None = None,  # the runs of token_slots (SGMV); None: one token a program (BGMV)
    *,
    config: LoraConfig | None = None,
) -> torch.Tensor:  # [S, T, R] float32
    """`v[s, t] = a[slot(t), s] @ x[t]` in float32, as `reference.lora_shrink`; zero rows for slot -1.
    `segments` must describe token_slots (the kernel reads the runs' slots, not token_slots)."""
    if x.dim() != 2 or a.dim() != 4 or a.shape[3] != x.shape[1]:
        raise ValueError(
            f"lora_shrink: want x [T, K] and a [num_slots, S, R, K]; got {tuple(x.shape)}, {tuple(a.shape)}"
        )
    if x.dtype not in _DTYPES or a.dtype != x.dtype:
        raise ValueError(f"lora_shrink: x and a must share a dtype of {_DTYPES}; got {x.dtype}, {a.dtype}")
    if x.stride(-1) != 1 or a.stride(-1) != 1:
        raise ValueError(f"lora_shrink: x and a must be contiguous in K, strides {x.stride()}, {a.stride()}")
    num_tokens, k = x.shape
    _, num_slices, rank, _ = a.shape
    _check_inputs("lora_shrink", (x, a), token_slots, segments)
    cfg = _config(config, x.device)
    v = torch.zeros((num_slices, num_tokens, rank), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or num_slices == 0 or rank == 0 or k == 0:
        return v
    r_pow2 = _rank_pow2(rank)
    sr_pow2 = triton.next_power_of_2(num_slices * r_pow2)
    strides = (x.stride(0), a.stride(0), a.stride(1), a.stride(2), v.stride(0), v.stride(1))
    if segments is None:
        gemv = replace(cfg, block_k=max(16, cfg.gemv_tile // sr_pow2))
        splits, k_per_split = _split_k(num_tokens, k, gemv, x.device)
        _bgmv_shrink_kernel[(num_tokens, splits)](
            x, a, token_slots, v, k, rank, k_per_split, *strides,
            NUM_SLICES=num_slices, R_POW2=r_pow2, SR_POW2=sr_pow2, BLOCK_K=gemv.block_k, ATOMIC=splits > 1,
            num_warps=cfg.num_warps,
        )  # fmt: skip
        return v
    num_runs = segments.slots.shape[0]
    num_t_tiles = triton.cdiv(segments.max_len, cfg.block_t)
    if num_runs == 0 or num_t_tiles == 0:
        return v
    splits, k_per_split = _split_k(num_runs * num_t_tiles, k, cfg, x.device)
    bf16_in_interpreter = INTERPRETED and x.dtype == torch.bfloat16
    _sgmv_shrink_kernel[(num_runs * num_t_tiles, splits)](
        x, a, segments.starts, segments.slots, v, k, rank, k_per_split, num_t_tiles, *strides,
        NUM_SLICES=num_slices, R_POW2=r_pow2, SR_POW2=sr_pow2, BLOCK_T=cfg.block_t, BLOCK_K=cfg.block_k,
        ATOMIC=splits > 1, DOT_DTYPE=tl.float32 if bf16_in_interpreter else _TL_DTYPES[x.dtype],
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return v


def lora_expand(
    v: torch.Tensor,  # [S, T, R] float32
    b: torch.Tensor,  # [num_slots, N, R]
    token_slots: torch.Tensor,  # [T] int32, -1: no adapter
    y: torch.Tensor,  # [T, N], added to in place
    slice_starts: tuple[int, ...],  # S + 1 column offsets: slice s owns y[:, starts[s]:starts[s + 1]]
    segments: LoraSegments | None = None,
    *,
    config: LoraConfig | None = None,
) -> None:
    """`y[t, n] += v[s, t] @ b[slot(t), n]` for the slice s owning column n, as `reference.lora_expand`;
    rows of slot -1 are not touched. `segments` must describe token_slots."""
    if v.dim() != 3 or b.dim() != 3 or y.dim() != 2 or b.shape[2] != v.shape[2] or b.shape[1] != y.shape[1]:
        raise ValueError(
            f"lora_expand: want v [S, T, R], b [num_slots, N, R], y [T, N]; got {tuple(v.shape)}, "
            f"{tuple(b.shape)}, {tuple(y.shape)}"
        )
    num_slices, num_tokens, rank = v.shape
    if v.dtype != torch.float32 or b.dtype not in _DTYPES or y.dtype not in _DTYPES:
        raise ValueError(
            f"lora_expand: want v float32, b and y of {_DTYPES}; got {v.dtype}, {b.dtype}, {y.dtype}"
        )
    if y.shape[0] != num_tokens:
        raise ValueError(f"lora_expand: y has {y.shape[0]} rows for {num_tokens} tokens of v")
    starts = tuple(int(n) for n in slice_starts)
    if (
        len(starts) != num_slices + 1
        or starts[0] != 0
        or starts[-1] != y.shape[1]
        or any(lo > hi for lo, hi in itertools.pairwise(starts))
    ):
        raise ValueError(
            f"lora_expand: slice_starts {slice_starts} must rise from 0 to N = {y.shape[1]} in S + 1 = "
            f"{num_slices + 1} steps"
        )
    if v.stride(-1) != 1 or b.stride(-1) != 1 or y.stride(-1) != 1:
        raise ValueError(
            f"lora_expand: v, b and y must be contiguous in their last dim, strides {v.stride()}, "
            f"{b.stride()}, {y.stride()}"
        )
    _check_inputs("lora_expand", (y, v, b), token_slots, segments)
    cfg = _config(config, y.device)
    max_slice = max((hi - lo for lo, hi in itertools.pairwise(starts)), default=0)
    if num_tokens == 0 or num_slices == 0 or rank == 0 or max_slice == 0:
        return
    r_pow2 = _rank_pow2(rank)
    strides = (v.stride(0), v.stride(1), b.stride(0), b.stride(1), y.stride(0))
    if segments is None:
        block_n = max(16, cfg.gemv_tile // r_pow2)
        grid = (num_tokens, triton.cdiv(max_slice, block_n), num_slices)
        _bgmv_expand_kernel[grid](
            v, b, token_slots, y, starts, rank, *strides,
            NUM_SLICES=num_slices, R_POW2=r_pow2, BLOCK_N=block_n, num_warps=cfg.num_warps,
        )  # fmt: skip
        return
    num_runs = segments.slots.shape[0]
    num_t_tiles = triton.cdiv(segments.max_len, cfg.block_t)
    if num_runs == 0 or num_t_tiles == 0:
        return
    grid = (num_runs * num_t_tiles, triton.cdiv(max_slice, cfg.block_n), num_slices)
    _sgmv_expand_kernel[grid](
        v, b, segments.starts, segments.slots, y, starts, rank, num_t_tiles, *strides,
        NUM_SLICES=num_slices, R_POW2=r_pow2, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n,
        DOT_PRECISION="ieee" if b.dtype == torch.float32 else "tf32", num_warps=cfg.num_warps,
    )  # fmt: skip
