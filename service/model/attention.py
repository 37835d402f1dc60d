"""Paged attention as a model layer: writes this step's K/V into the cache (rotating q and k in the
same launch when asked), then attends."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pagoda import kernels
from pagoda.kernels import cudnn_attention
from pagoda.kernels.kv_cache import cache_view


@dataclass(frozen=True)
class LongChunk:
    """A prompt chunk of `LONG_CHUNK_TOKENS` or more in an eager step, which `cudnn_attention`
    attends rather than the paged kernel (where the device has it: `cudnn_attention.is_supported`)."""

    row: int  # its sequence's row of the batch (block_tables, seq_lens)
    start: int  # its query tokens are the step's [start, end)
    end: int
    context_len: int  # its context, this chunk included

    @property
    def whole_prompt(self) -> bool:
        """No cached prefix: the chunk is its whole context, so its own K/V are all it attends."""
        return self.context_len == self.end - self.start


# From this many query tokens a chunk's attention is a dense causal attention that cuDNN runs faster
# than the paged kernel (`cudnn_attention`'s docstring has the numbers). Half the default 8192-token
# budget, not all of it: once one sequence decodes, the others' chunks are 8192 minus the decoding rows,
# and at 8192 those stayed on the paged kernel (H100, fp8: 8 x 32k in / 256 out 13.7 s at 8192, 10.7 s
# at 4096; 64 x 8k / 512 20.0 s -> 18.9 s). At 2k-token chunks and less the paged kernel was at SDPA's
# speed (BENCHMARKS.md) and a CUDA graph may hold the step.
LONG_CHUNK_TOKENS = 4096
# A whole prompt (no cached prefix) of this many tokens or more in an eager step is attended by cuDNN on
# the keys and values the step computed (`cudnn_attention.prompt_attention`), with no cache read. One
# H100, 4 x 2,048-token prompts, Llama-3-8B heads (`pagoda bench kernels --sweep fresh-prompts`,
# BENCHMARKS.md 2026-12-06): 346 us a layer against the paged kernel's 558 over an fp8 cache (462 bf16);
# 8 x 1,000 258 against 311. From 2,048 a prompt's padding to the next SHAPE_BUCKET (512) costs at most a
# quarter of its rows.
WHOLE_PROMPT_TOKENS = 2048


@dataclass
class AttentionMetadata:
    """The flattened batch's layout, built once per step by the model runner (tensors on the device)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token (-1: padding)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    # False where no sequence has a single query token (an eager prompt step, the runs between long
    # chunks): the decode kernels are not launched. A CUDA graph's is True: its replays' rows change.
    decode_rows: bool
    long_chunks: tuple[LongChunk, ...] = ()
    # With long_chunks: the other sequences, as the runs between them, each (start, end) of the step's
    # tokens and the run's own layout; a step without them leaves this empty.
    paged_runs: tuple[tuple[int, int, AttentionMetadata], ...] = ()
    # Whole prompts' own-row buffers (`PagedAttention._own_rows`), made by the step's first layer and
    # reused by the others (each layer's rotary launch overwrites the rows, in stream order after the
    # layer before read them), keyed by their heads and dtype.
    own_rows: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )


class PagedAttention(nn.Module):
    """Holds no weights; the model runner binds `k_cache`/`v_cache` after allocating the cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.k_cache = torch.empty(0)  # [num_blocks, block_size, num_kv_heads, head_dim]
        self.v_cache = torch.empty(0)
        # An fp8 cache holds K / k_scale and V / v_scale. 1.0, as vLLM without calibrated scales: e4m3
        # reaches 448, far above the keys and values of the models measured (README, fp8).
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,  # (positions, cos_sin_cache)
        scaled: tuple[tuple[torch.Tensor, torch.Tensor], torch.dtype] | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """With `rotary`, q and k are rotated first (in place), in the launch that writes the cache.
        `scaled` ((row, column) scales, dtype): q, k, v are an fp8 qkv product still to be scaled, which
        that launch does too (with `rotary` only); the rotated q then comes in a new tensor."""
        kv_write = (v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        own = self._own_rows(q, k, meta, rotary is not None, scaled)
        if rotary is None:
            if scaled is not None:
                raise ValueError(
                    "PagedAttention: an unscaled qkv product is scaled by the rotary launch only"
                )
            kernels.write_kv(k, *kv_write)
        elif own is not None:
            q_out, k_out, v_out = (t[: q.shape[0]] for t in own)
            scales, dtype = scaled if scaled is not None else (None, None)
            kernels.rotary_embedding(
                rotary[0], q, k, rotary[1], kv_write, scales, dtype, q_out, (k_out, v_out)
            )
            q = q_out
        elif scaled is None:
            kernels.rotary_embedding(rotary[0], q, k, rotary[1], kv_write)
        else:
            scales, dtype = scaled
            q_out = torch.empty(q.shape, dtype=dtype, device=q.device)
            kernels.rotary_embedding(rotary[0], q, k, rotary[1], kv_write, scales, dtype, q_out)
            q = q_out
        if meta.long_chunks and cudnn_attention.is_supported(q):
            return self._attend_long_chunks(q, meta, own)
        return self._paged(q, meta)

    def _own_rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        meta: AttentionMetadata,
        rotary: bool,
        scaled: tuple[tuple[torch.Tensor, torch.Tensor], torch.dtype] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where the step has whole prompts for `cudnn_attention.prompt_attention`: buffers for the
        rotary launch's q, K and V, token-major, with SHAPE_BUCKET - 1 rows past the step's end (a
        prompt's call reads up to its bucket). Those K and V rows are zeroed: on the CPU a NaN there
        reached real rows' outputs; q's are left, their outputs dropped. Made once a step
        (`AttentionMetadata.own_rows`): every layer's rotary launch writes the same rows, never the tail."""
        if not rotary or not any(c.whole_prompt for c in meta.long_chunks):
            return None
        dtype = scaled[1] if scaled is not None else q.dtype
        key = (self.num_heads, k.shape[1], self.head_dim, dtype)  # the step fixes the rows and device
        if key in meta.own_rows:
            return meta.own_rows[key]
        if not cudnn_attention.is_supported(q.new_empty((0, *q.shape[1:]), dtype=dtype)):
            return None
        rows, pad = q.shape[0], cudnn_attention.SHAPE_BUCKET - 1
        own = tuple(
            torch.empty((rows + pad, heads, self.head_dim), dtype=dtype, device=q.device)
            for heads in (self.num_heads, k.shape[1], k.shape[1])
        )
        for t in own[1:]:
            t[rows:].zero_()
        meta.own_rows[key] = own  # type: ignore[assignment]
        return own  # type: ignore[return-value]

    def _paged(
        self, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return kernels.paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            meta.max_query_len,
            meta.max_seq_len,
            self.k_scale,
            self.v_scale,
            meta.decode_rows,
            out,
        )

    def build_long_chunk_plans(self, chunk: int, max_model_len: int, dtype: torch.dtype) -> list[int]:
        """Attend a `chunk`-token chunk behind prefixes of 1, 2, ... whole chunks up to `max_model_len`,
        as a long prompt alone in its steps is cut: cuDNN builds a plan per new (query, key) shape, 80 to
        180 ms each on an H100 (BENCHMARKS.md, 2026-12-06), which would stall the step (and every request
        in it) that first needs one. Reads block 0 only, writes no cache. The context lengths attended;
        none where `cudnn_attention` does not run (fp32, such heads, no cuDNN). Chunks of other lengths
        (prompts beside decodes) still build theirs on first use."""
        q = torch.zeros((chunk, self.num_heads, self.head_dim), dtype=dtype, device=self.k_cache.device)
        if not cudnn_attention.is_supported(q):
            return []
        blocks = torch.zeros(-(-max_model_len // self.k_cache.shape[1]), dtype=torch.int32, device=q.device)
        out = torch.empty_like(q)
        contexts = list(range(2 * chunk, max_model_len + 1, chunk))
        for context_len in contexts:
            cudnn_attention.chunk_attention(
                q, self.k_cache, self.v_cache, blocks, context_len, self.scale, out
            )
        return contexts

    def compile_decode_variants(self, max_seq_len: int, dtype: torch.dtype) -> list[int]:
        """Compile the decode kernels for every split count contexts up to `max_seq_len` can take
        (`kernels.attention.compile_decode_variants`), before the first request. The split counts
        launched; none where the Triton kernels do not run (the CPU's reference)."""
        q = torch.zeros((1, self.num_heads, self.head_dim), dtype=dtype, device=self.k_cache.device)
        if not kernels.use_triton(q):
            return []
        from pagoda.kernels.attention import compile_decode_variants

        return compile_decode_variants(q, self.k_cache, self.v_cache, max_seq_len, self.k_scale, self.v_scale)

    def build_whole_prompt_plans(self, first: int, last: int, dtype: torch.dtype) -> list[int]:
        """cuDNN's plans for whole prompts of `first` to `last` tokens (`prompt_attention`'s calls, one per
        SHAPE_BUCKET-rounded length), on zeros laid out as `forward` lays out a step's own rows: built
        here, not mid-traffic (`build_long_chunk_plans` says what a plan costs). The lengths attended;
        none where `cudnn_attention` does not run."""
        q = torch.zeros((0, self.num_heads, self.head_dim), dtype=dtype, device=self.k_cache.device)
        if not cudnn_attention.is_supported(q) or first > last:
            return []
        bucket = cudnn_attention.SHAPE_BUCKET
        lengths = list(range(-(-first // bucket) * bucket, -(-last // bucket) * bucket + 1, bucket))
        for n in lengths:
            own = [
                q.new_zeros((n, heads, self.head_dim))
                for heads in (self.num_heads,) + (self.num_kv_heads,) * 2
            ]
            cudnn_attention.prompt_attention(*own, n, self.scale, torch.empty_like(own[0]))
        return lengths

    def _attend_long_chunks(
        self,
        q: torch.Tensor,
        meta: AttentionMetadata,
        own: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for start, end, run in meta.paged_runs:
            self._paged(q[start:end], run, out[start:end])
        for c in meta.long_chunks:
            if own is not None and c.whole_prompt:
                oq, ok, ov = (t[c.start :] for t in own)
                cudnn_attention.prompt_attention(
                    oq, ok, ov, c.end - c.start, self.scale, out[c.start : c.end]
                )
                continue
            cudnn_attention.chunk_attention(
                q[c.start : c.end], self.k_cache, self.v_cache, meta.block_tables[c.row], c.context_len,
                self.scale, out[c.start : c.end], self.k_scale, self.v_scale,
            )  # fmt: skip
        return out


def kv_block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one block of `allocate_kv_cache`'s tensor: K and V of `block_size` tokens in every layer."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def allocate_kv_cache(
    layers: list[PagedAttention],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    v_token_major: bool,
) -> torch.Tensor:  # [K/V, layer, block, slot x head x dim]
    """One tensor holding the K and V caches of `layers` (a model's, a pipeline stage's, a draft
    model's), each layer's `k_cache` / `v_cache` bound to its views (`kernels.kv_cache.cache_view`;
    V token-major if asked). Zeroed: the decode kernel reads the slots past a context's end
    (`DecodeConfig.finite_cache`), which must hold no NaN."""
    num_kv_heads, head_dim = layers[0].num_kv_heads, layers[0].head_dim
    cache = torch.zeros(  # never NaN, written or not (kernels.kv_cache: attention reads past a context)
        2, len(layers), num_blocks, block_size * num_kv_heads * head_dim, dtype=dtype, device=device
    )
    for i, layer in enumerate(layers):
        layer.k_cache = cache_view(cache[0, i], block_size, num_kv_heads, head_dim, token_major=False)
        layer.v_cache = cache_view(cache[1, i], block_size, num_kv_heads, head_dim, token_major=v_token_major)
    return cache


def copy_kv_blocks(cache: torch.Tensor, copy_ops: list[tuple[int, int]]) -> None:
    """Copy-on-write: each (source, destination) block's K and V in every layer."""
    for src, dst in copy_ops:
        cache[:, :, dst].copy_(cache[:, :, src])
