"""A long prompt chunk's attention through a library kernel (cuDNN's fused attention on the GPU).

For a chunk of thousands of query tokens, the paged kernel's work is a dense causal attention, and
cuDNN's runs it faster: one H100, an 8k-token chunk last in a 32k context, Llama-3-8B heads
(`pagoda bench kernels --sweep long-prefill-sdpa`, BENCHMARKS.md 2026-12-05): 6.07 ms at 634 TFLOP/s
against 9.40 ms for ours (bf16 cache) and 10.90 ms (fp8 cache); gathering the paged prefix into
contiguous K/V costs 0.1-0.16 ms for 24k tokens, once a layer.

cuDNN's causal mask is top-left aligned (query i sees keys 0..i), right only when the queries are the
whole context. A chunk after a cached prefix is therefore two calls: the queries against the prefix
(no mask) and against the chunk itself (causal, square), each returning its log-sum-exp, merged as
flash-decoding merges its splits. PyTorch's public `scaled_dot_product_attention` returns no
log-sum-exp, so the calls are the ATen ops behind it: `_scaled_dot_product_cudnn_attention` on CUDA,
`_scaled_dot_product_flash_attention_for_cpu` elsewhere (tests; the CPU engine). Both take grouped
query heads as they are (8 kv heads for 32 query heads), checked against the paged kernel and the
reference in tests/kernels/check_cudnn_attention.py (on an H100 and in the interpreter). In the engine
(BENCHMARKS.md 2026-12-06, H100, fp8): a 32k prompt's TTFT 1.27 s -> 0.98 s, 8 x 32k prompts 13.7 s ->
10.7 s.

An fp8 cache is widened to q's dtype in the gather; k_scale goes into the softmax scale and v_scale
onto the output, as in the paged kernel.

A whole prompt (no cached prefix) needs no gather: `prompt_attention` hands cuDNN the K and V the step
computed (the rotary launch's `kv_out`, in q's dtype, before an fp8 cache rounds them), in one causal
call. On one H100 at Llama-3-8B heads that call took 346 us a layer for 4 x 2,048-token prompts against
558 for the paged kernel over an fp8 cache (BENCHMARKS.md 2026-12-06, fourteenth session), where the
gathers and copies of `chunk_attention` ate cuDNN's lead at 2k tokens.
"""

from __future__ import annotations

import functools

import torch

from pagoda.kernels import reference, use_triton

_DTYPES = (torch.float16, torch.bfloat16)


def is_supported(q: torch.Tensor) -> bool:
    """Whether `chunk_attention` runs for these queries: 16-bit, head_dim a multiple of 8 up to 128
    (cuDNN's fused kernels), on the CPU or on a GPU whose cuDNN has them (compute capability 8.0+)."""
    head_dim = q.shape[-1]
    return q.dtype in _DTYPES and head_dim % 8 == 0 and head_dim <= 128 and _has_kernels(q.device)


@functools.cache
def _has_kernels(device: torch.device) -> bool:
    if device.type != "cuda":
        return device.type == "cpu"
    return torch.backends.cudnn.is_available() and torch.cuda.get_device_capability(device) >= (8, 0)


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], slot- or token-major
    block_ids: torch.Tensor,  # [>= cdiv(num_tokens, block_size)] the sequence's block table row
    num_tokens: int,
    dtype: torch.dtype,
    length: int | None = None,  # the result's tokens (>= num_tokens): those past num_tokens are zero
    token_major: bool = False,
) -> torch.Tensor:  # [kv_heads, length, head_dim] contiguous; token_major: [length, kv_heads, head_dim]
    """A sequence's first `num_tokens` cached keys (or values) as one dense tensor of `dtype`.

    Whole blocks are gathered as flat rows (each block is one contiguous run in either layout, so the
    copy reads in long runs), then laid out head-major in the dtype cast; with `token_major`, token by
    token as a slot-major cache holds them (the cast then copies in order, no transpose), for a caller
    that hands cuDNN a strided head-major view."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    block_elems = block_size * num_kv_heads * head_dim
    if cache.stride(0) != block_elems:
        raise ValueError(f"gather_context: cache blocks must be contiguous runs, strides {cache.stride()}")
    length = num_tokens if length is None else length
    n = -(-num_tokens // block_size)
    flat = cache.as_strided((num_blocks, block_elems), (block_elems, 1))
    rows = flat.index_select(0, block_ids[:n].long())  # [n, block_elems]
    blocks = rows.as_strided((n, block_size, num_kv_heads, head_dim), (block_elems, *cache.stride()[1:]))
    if token_major:
        rows_out = torch.empty(
            (max(length, n * block_size), num_kv_heads, head_dim), dtype=dtype, device=cache.device
        )
        rows_out[: n * block_size].view(n, block_size, num_kv_heads, head_dim).copy_(blocks)
        rows_out[num_tokens:].zero_()
        return rows_out[:length]
    out = torch.empty((num_kv_heads, max(length, n * block_size), head_dim), dtype=dtype, device=cache.device)
    out[:, : n * block_size].view(num_kv_heads, n, block_size, head_dim).copy_(blocks.permute(2, 0, 1, 3))
    out[:, num_tokens:].zero_()
    return out[:, :length]


def _attend(
    q: torch.Tensor,  # [1, num_heads, q_len, head_dim]
    k: torch.Tensor,  # [1, num_kv_heads, kv_len, head_dim]
    v: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_heads, q_len, head_dim], log-sum-exp [num_heads, q_len]
    if k.shape != v.shape or (causal and q.shape[2] != k.shape[2]):
        # PyTorch's CPU op reads past a shorter K's view instead of refusing it (a mutant showed it).
        raise ValueError(f"cudnn_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
    return out[0], lse.reshape(q.shape[1], q.shape[2])


# cuDNN builds an execution plan for each new (query, key) length, tens to hundreds of milliseconds
# (flashinfer-ai/flashinfer#5245: 55-70 ms on SM100; sgl-project/sglang#4650: ~400 ms on H20). Both
# calls' lengths are therefore multiples of SHAPE_BUCKET: padded rows cost at most SHAPE_BUCKET - 1
# query rows at each end of an 8k-token chunk, and a process sees few distinct shapes.
SHAPE_BUCKET = 512


def transient_bytes(
    chunk: int, context_len: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """At most how many bytes `chunk_attention` holds at once for a `chunk`-token chunk that ends a
    context of at most `context_len` tokens, over every alignment of the chunk to SHAPE_BUCKET: the
    gathered K and V, the padded queries, and the two calls' outputs with their float32 log-sum-exps.
    A layer's transient, freed before the next; cuDNN's own workspace is not in it. The KV cache's budget
    leaves room for it (the runner's `step_activation_bytes`): at 131,072 tokens of an 8B model's heads
    it is ~0.75 GB, beside the ~1 GB of an 8192-token step's other activations."""
    bucket, size = SHAPE_BUCKET, dtype.itemsize
    rows = -(-(chunk + bucket - 1) // bucket) * bucket  # the causal call's, the prefix's remainder included
    keys = -(-context_len // bucket) * bucket  # split + rows (a block size dividing the bucket: no more)
    return 2 * num_kv_heads * keys * head_dim * size + num_heads * rows * (3 * head_dim * size + 2 * 4)


def prompt_attention(
    q: torch.Tensor,  # [>= rows, num_heads, head_dim]: the step's rotated queries from the prompt's first
    k: torch.Tensor,  # [>= rows, num_kv_heads, head_dim]: its rotated keys (`rotary_embedding(kv_out=)`)
    v: torch.Tensor,  # [>= rows, num_kv_heads, head_dim]
    q_len: int,  # the prompt's tokens: the whole context (no cached prefix)
    scale: float,
    out: torch.Tensor,  # [q_len, num_heads, head_dim], written
    bucket: int | None = None,  # SHAPE_BUCKET
) -> None:
    """Causal attention of a whole prompt over its own keys and values, as this step computed them (in
    q's dtype, before an fp8 cache rounds them), where `chunk_attention` would gather them back from the
    cache: one call on strided head-major views of the step's token-major rows.

    The call's length is `q_len` rounded up to `bucket` (cuDNN builds a plan per shape), so it reads
    `rows - q_len` rows past the prompt: whatever follows it in the step (the next sequence's tokens,
    or the zeroed rows the caller leaves past the step's end). Under the top-left causal mask a real
    query at position p sees keys 0..p only, never those rows; their own outputs are dropped."""
    bucket = bucket or SHAPE_BUCKET
    rows = -(-q_len // bucket) * bucket
    if out.shape[0] != q_len or q_len < 1 or any(t.shape[0] < rows for t in (q, k, v)):
        raise ValueError(
            f"prompt_attention: a {q_len}-token prompt takes {rows} rows of q, k and v (got "
            f"{q.shape[0]}, {k.shape[0]}, {v.shape[0]}) and an out of {q_len} (got {out.shape[0]})"
        )
    qh, kh, vh = (t[:rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    own, _ = _attend(qh, kh, vh, causal=True, scale=scale)
    out.copy_(own[:, :q_len].transpose(0, 1))


def chunk_attention(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]: the last q_len positions of the context
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [max_blocks_per_seq] this sequence's block table row
    context_len: int,  # tokens cached so far, this chunk's included
    scale: float,
    out: torch.Tensor,  # [q_len, num_heads, head_dim], written
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    bucket: int | None = None,  # SHAPE_BUCKET
    token_major: bool = True,
) -> None:
    """Causal attention of one sequence's chunk of queries over its paged context.

    The context splits at `split`, the prefix length rounded down to `bucket`. Keys before it are
    seen by every query (one unmasked call); keys from it on take a top-left causal call whose query
    rows start at position `split` too: the `prefix - split` rows ahead of the chunk's queries are
    zeros, as are the rows and keys padding that call to a multiple of `bucket`. A real query at
    position p then sees keys split..p, and no padded key (they sit past every real position). The
    unmasked call takes the same padded rows, and the two merge by their log-sum-exp.

    With `token_major` (the default), q, K and V go to the calls as strided head-major views of
    token-major tensors (q itself when no row needs padding, else its padding rows left unwritten,
    their outputs dropped; K and V gathered in the cache's token order), and the outputs come back in
    whatever layout the call chose. `token_major=False` copies all three head-major first, as before:
    on one H100 (BENCHMARKS.md, 2026-12-06, fifteenth session) those copies cost 2048 / 128 with
    `--long-chunk-tokens 2048` 2.3% of its tok/s, the views nothing; a 32k prompt's TTFT 1-2%."""
    q_len, num_heads, head_dim = q.shape
    prefix = context_len - q_len
    if prefix < 0 or out.shape != q.shape:
        raise ValueError(
            f"chunk_attention: {q_len} queries in a {context_len}-token context, out {tuple(out.shape)}"
        )
    bucket = bucket or SHAPE_BUCKET
    split = prefix // bucket * bucket
    rows = -(-(context_len - split) // bucket) * bucket  # the causal call's (square) length
    first = prefix - split  # the chunk's first query row
    if token_major:
        k, v = (
            gather_context(c, block_ids, context_len, q.dtype, split + rows, True)
            .transpose(0, 1)
            .unsqueeze(0)
            for c in (k_cache, v_cache)
        )
        if first == 0 and q_len == rows:
            qh = q.transpose(0, 1).unsqueeze(0)
        else:
            padded = q.new_empty((rows, num_heads, head_dim))  # the padding rows' outputs are dropped
            padded[first : first + q_len] = q
            qh = padded.transpose(0, 1).unsqueeze(0)
    else:
        k = gather_context(k_cache, block_ids, context_len, q.dtype, split + rows).unsqueeze(0)
        v = gather_context(v_cache, block_ids, context_len, q.dtype, split + rows).unsqueeze(0)
        qh = q.new_zeros((1, num_heads, rows, head_dim))
        qh[0, :, first : first + q_len] = q.transpose(0, 1)
    s = scale * k_scale
    own, own_lse = _attend(qh, k[:, :, split:], v[:, :, split:], causal=True, scale=s)
    own, own_lse = own[:, first : first + q_len], own_lse[:, first : first + q_len]
    if split == 0:
        out.copy_((own * v_scale if v_scale != 1.0 else own).transpose(0, 1))
        return
    before, before_lse = _attend(qh, k[:, :, :split], v[:, :, :split], causal=False, scale=s)
    before, before_lse = before[:, first : first + q_len], before_lse[:, first : first + q_len]
    if use_triton(out):
        from pagoda.kernels.lse_merge import merge_attention
    else:
        merge_attention = reference.merge_attention
    merge_attention(out, own, own_lse, before, before_lse, v_scale)
