"""Triton kernels for the hot path, each beside its plain-PyTorch reference (`reference.py`).

The functions here are what the engine calls. Each takes the layouts documented in
`reference.py`; on a CUDA tensor it runs the Triton kernel, elsewhere the reference.

`PAGODA_KERNELS` overrides the choice: `triton` forces the Triton kernels (on CPU tensors this
needs `TRITON_INTERPRET=1`, which is how the tests run them without a GPU), `reference` forces the
references, `auto` (or unset) picks by device. Triton is imported only when a kernel is used, so
CPU-only code paths work without it.

The hot path's kernels launch with programmatic dependent launch on Hopper GPUs (`pdl.py`: each
starts while the kernel before it drains and waits for it first); `PAGODA_PDL=0` turns it off.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.kernels import reference

__all__ = [
    "LoraSegments",
    "argmax",
    "fill_seeded_noise",
    "lora_expand",
    "lora_shrink",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv",
]

_MODES = ("auto", "triton", "reference")


def use_triton(t: torch.Tensor) -> bool:
    """Whether a kernel called on `t` runs the Triton version (see the module docstring)."""
    mode = os.environ.get("PAGODA_KERNELS", "auto") or "auto"
    if mode not in _MODES:
        raise ValueError(f"PAGODA_KERNELS={mode!r}: want one of {_MODES}")
    if mode == "auto":
        return t.is_cuda
    return mode == "triton"


def _triton_fn(module: str, name: str) -> Callable[..., Any]:
    # Module names differ from the function names here: importing a submodule binds its name on
    # this package, which would shadow the dispatcher of the same name.
    return getattr(importlib.import_module(f"pagoda.kernels.{module}"), name)


def argmax(x: torch.Tensor) -> torch.Tensor:  # [rows, cols] -> [rows] int64
    """Each row's first index of its largest value, as `x.argmax(dim=1)`; on the GPU split over the row
    (`argmax_rows`), which PyTorch's one block a row is not."""
    if use_triton(x):
        return _triton_fn("argmax_rows", "argmax")(x)
    return x.argmax(dim=1)


def fill_seeded_noise(
    noise: torch.Tensor,  # [num_rows, vocab] float32: the seeded rows written
    seeded: torch.Tensor,  # [s, 3] int32: a row of noise, its key's low and high halves (one upload)
    uniform: torch.Tensor | None = None,  # [num_rows] float32: the seeded rows written
) -> None:
    """Seeded rows' Exp(1) noise, each row a function of its key alone (a counter-based hash of key
    and column, `reference.fill_seeded_noise`); with `uniform`, also one uniform a row (the hash's
    column after the vocabulary)."""
    fn = _triton_fn("seeded_noise", "fill_seeded_noise") if use_triton(noise) else reference.fill_seeded_noise
    fn(noise, seeded, uniform)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; a negative slot is skipped (graph padding)
    k_scale: float = 1.0,  # an fp8 (float8_e4m3fn) cache holds key / k_scale
    v_scale: float = 1.0,
) -> None:
    """Scatter the new tokens' K and V into their cache slots."""
    fn = _triton_fn("kv_cache", "write_kv") if use_triton(key) else reference.write_kv
    fn(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


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
    decode_rows: bool = True,  # False: no sequence has a single query token (the Triton path skips decode)
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim], written when given
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's query tokens over its paged context (GQA aware); the cache
    may be q's dtype or float8_e4m3fn."""
    if use_triton(q):
        return _triton_fn("attention", "paged_attention")(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, max_seq_len,
            k_scale=k_scale, v_scale=v_scale, decode_rows=decode_rows, out=out,
        )  # fmt: skip
    if not decode_rows and bool((query_start_loc[1:] - query_start_loc[:-1] == 1).any()):
        # The Triton path would leave such a row unwritten; the reference checks (it syncs anyway).
        raise ValueError("paged_attention: decode_rows=False, but a sequence has a single query token")
    result = reference.paged_attention(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len, max_seq_len,
        k_scale, v_scale,
    )  # fmt: skip
    return result if out is None else out.copy_(result)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
    quantize: bool = False,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    scaled_dtype: torch.dtype | None = None,
) -> tuple[Any, torch.Tensor | None]:
    """RMSNorm, with the residual add fused in front; returns `(normed, x + residual)`. With
    `quantize`, `normed` is `(fp8 codes, float32 scale per row)`: an fp8 projection's input.
    `scales` (row, column): `x` is an fp8 product still to be scaled into `scaled_dtype` first."""
    if use_triton(x):
        fn = _triton_fn("norm", "rms_norm")
        return fn(x, weight, eps, residual, quantize=quantize, scales=scales, scaled_dtype=scaled_dtype)
    if scales is not None:
        x = reference.scale_product(x, *scales, scaled_dtype or x.dtype)
    normed, residual = reference.rms_norm(x, weight, eps, residual)
    return (reference.quantize_fp8_rows(normed) if quantize else normed), residual


def silu_and_mul(
    x: torch.Tensor,  # [num_tokens, 2 * d]
    quantize: bool = False,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    scaled_dtype: torch.dtype | None = None,
) -> Any:  # [num_tokens, d]
    """SwiGLU's gate: `silu(x[:, :d]) * x[:, d:]`; with `quantize`, as (fp8 codes, float32 scale per row).
    `scales` (row, column): `x` is an fp8 product still to be scaled into `scaled_dtype` first."""
    if use_triton(x):
        fn = _triton_fn("activation", "silu_and_mul")
        return fn(x, quantize=quantize, scales=scales, scaled_dtype=scaled_dtype)
    if scales is not None:
        x = reference.scale_product(x, *scales, scaled_dtype or x.dtype)
    out = reference.silu_and_mul(x)
    return reference.quantize_fp8_rows(out) if quantize else out


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32: cos in the first half, sin in the second
    kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float] | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    scaled_dtype: torch.dtype | None = None,
    q_out: torch.Tensor | None = None,
    kv_out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Rotary position embedding in the rotate-half (GPT-NeoX / Hugging Face Llama) layout. `kv_write`:
    (value, k_cache, v_cache, slot_mapping, k_scale, v_scale): then write the rotated K and the V into
    the cache too, as `write_kv(k, *kv_write)` after it (one launch on the GPU). `scales` (row, column):
    q, k, v are an fp8 qkv product still to be scaled into `scaled_dtype`; the rotated q goes to `q_out`,
    k and v to the cache only. `q_out` without `scales`: the rotated q goes there, q stays. `kv_out`
    (with `kv_write`): the rotated K and the V in q's (or `scaled_dtype`) dtype go there as well."""
    if use_triton(q):
        fn = _triton_fn("rotary", "rotary_embedding")
        fn(positions, q, k, cos_sin_cache, kv_write, scales=scales, scaled_dtype=scaled_dtype, q_out=q_out,
           kv_out=kv_out)  # fmt: skip
        return
    if kv_out is not None and kv_write is None:
        raise ValueError("rotary_embedding: kv_out goes with kv_write")
    if scales is not None:
        assert kv_write is not None and q_out is not None and scaled_dtype is not None
        row, col = scales
        num_tokens, q_cols, kv_cols = q.shape[0], q[0].numel(), k[0].numel()
        parts = col.reshape(1, -1).split([q_cols, kv_cols, kv_cols], dim=1)
        q, k, v = (
            reference.scale_product(x.reshape(num_tokens, -1), row, c, scaled_dtype).view(x.shape)
            for x, c in zip((q, k, kv_write[0]), parts, strict=True)
        )
        kv_write = (v, *kv_write[1:])  # type: ignore[assignment]
        reference.rotary_embedding(positions, q, k, cos_sin_cache)
        q_out.copy_(q)
    elif q_out is not None:
        q_out.copy_(q)
        reference.rotary_embedding(positions, q_out, k, cos_sin_cache)
    else:
        reference.rotary_embedding(positions, q, k, cos_sin_cache)
    if kv_write is not None:
        reference.write_kv(k, *kv_write)
        if kv_out is not None:
            kv_out[0].copy_(k)
            kv_out[1].copy_(kv_write[0])


@dataclass(frozen=True)
class LoraSegments:
    """Runs of consecutive tokens that share one slot (a prefill's sequences): the SGMV form."""

    starts: torch.Tensor  # [G + 1] int32 token offsets, starts[0] == 0, starts[G] == T
    slots: torch.Tensor  # [G] int32, the slot of each run (-1: no adapter)
    max_len: int  # the longest run, on the host (sizes the grid)


def lora_shrink(
    x: torch.Tensor,  # [T, K] activations (bf16, fp16 or fp32)
    a: torch.Tensor,  # [num_slots, S, R, K]: each slot's A of each slice, rank padded to R with zero rows
    token_slots: torch.Tensor,  # [T] int32: each token's slot, -1 for none
    segments: LoraSegments | None = None,  # given: SGMV over runs (prefill); None: BGMV, a token at a time
) -> torch.Tensor:  # [S, T, R] float32; rows of tokens with slot -1 are zero
    """A LoRA's first product for every token and slice, `v[s, t] = a[slot(t), s] @ x[t]`, each token
    with its own adapter. `segments` (the runs of `token_slots`) only pick the kernel's form."""
    if use_triton(x):
        return _triton_fn("lora", "lora_shrink")(x, a, token_slots, segments)
    return reference.lora_shrink(x, a, token_slots)


def lora_expand(
    v: torch.Tensor,  # [S, T, R] float32 (lora_shrink's output)
    b: torch.Tensor,  # [num_slots, N, R]: each slot's B of the S slices stacked along N, scaling folded in
    token_slots: torch.Tensor,  # [T] int32
    y: torch.Tensor,  # [T, N], added to in place
    slice_starts: tuple[int, ...],  # S + 1 ints: slice s owns columns slice_starts[s]:slice_starts[s + 1]
    segments: LoraSegments | None = None,
) -> None:
    """A LoRA's second product added to the projection's output: `y[t, n] += v[s(n), t] @ b[slot(t), n]`
    in float32, rounded once to y's dtype; rows of tokens with slot -1 are not touched."""
    if use_triton(y):
        _triton_fn("lora", "lora_expand")(v, b, token_slots, y, slice_starts, segments)
        return
    reference.lora_expand(v, b, token_slots, y, slice_starts)
