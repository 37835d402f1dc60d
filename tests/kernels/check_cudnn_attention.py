"""A long chunk's attention through cuDNN (`cudnn_attention`) against `reference.paged_attention`, and on
a GPU against the paged Triton kernel at Llama-3-8B's heads.

On the CPU (tests/test_kernels_interpret.py runs this file) the same code calls PyTorch's CPU flash
attention; the bucketing, the padded rows, the gather from either cache layout and the log-sum-exp
merge are the same. The reference computes in float32; tolerances are bf16's rounding of the output.
"""

from __future__ import annotations

import os

import pytest
import torch

from pagoda.kernels import kv_cache, reference
from pagoda.kernels.cudnn_attention import chunk_attention, gather_context, is_supported, prompt_attention

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA GPU", allow_module_level=True)

DEVICE = "cpu" if INTERPRET else "cuda"
FP8 = torch.float8_e4m3fn


def _cache(num_blocks: int, block_size: int, kv_heads: int, dim: int, dtype: torch.dtype, token_major: bool):
    k = torch.randn(num_blocks, block_size, kv_heads, dim, device=DEVICE).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, dim, device=DEVICE).to(dtype)
    return k, (kv_cache.token_major_copy(v) if token_major else v)


def _reference(q, k_cache, v_cache, blocks, context_len, k_scale, v_scale):
    q_len, _, dim = q.shape
    return reference.paged_attention(
        q, k_cache, v_cache, blocks[None],
        torch.tensor([context_len], dtype=torch.int32, device=DEVICE),
        torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE),
        dim**-0.5, q_len, context_len, k_scale, v_scale,
    )  # fmt: skip


@pytest.mark.parametrize("cache", ["bf16", "fp8", "fp8 V token-major"])
@pytest.mark.parametrize(
    ("context_len", "q_len", "bucket"),
    [
        (45, 45, 16),  # a whole prompt: one causal call, its rows padded to 48
        (61, 20, 16),  # prefix 41: split at 32, 9 zero rows ahead of the queries, then the merge
        (64, 32, 16),  # prefix 32, a whole bucket: no zero rows ahead
        (50, 35, 16),  # prefix 15 < bucket: one causal call over the context
        (70, 20, 8),
    ],
)
@pytest.mark.parametrize("views", [False, True], ids=["copies", "token-major views"])
def test_chunk_matches_the_reference(
    cache: str, context_len: int, q_len: int, bucket: int, views: bool
) -> None:
    torch.manual_seed(context_len * 100 + q_len)
    heads, kv_heads, dim, block_size, num_blocks = 8, 2, 32, 8, 24
    dtype = torch.bfloat16 if cache == "bf16" else FP8
    k_cache, v_cache = _cache(num_blocks, block_size, kv_heads, dim, dtype, cache.endswith("token-major"))
    k_scale, v_scale = (1.0, 1.0) if cache == "bf16" else (0.7, 1.6)
    blocks = torch.randperm(num_blocks, device=DEVICE).to(torch.int32)  # whole row; some past the context
    q = torch.randn(q_len, heads, dim, device=DEVICE, dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    chunk_attention(
        q, k_cache, v_cache, blocks, context_len, dim**-0.5, out, k_scale, v_scale, bucket, token_major=views
    )
    want = _reference(q, k_cache, v_cache, blocks, context_len, k_scale, v_scale)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2 * v_scale, rtol=2e-2)


def test_gather_reads_the_blocks_in_table_order_and_zeros_the_rest() -> None:
    k_cache, v_cache = _cache(6, 4, 2, 16, torch.bfloat16, token_major=True)
    blocks = torch.tensor([3, 0, 5, 1], dtype=torch.int32, device=DEVICE)
    for cache in (k_cache, v_cache):
        got = gather_context(cache, blocks, 10, torch.float32, length=16)  # [2, 16, 16]
        want = cache[blocks[:3].long()].flatten(0, 1)[:10].transpose(0, 1).float()
        assert got.shape == (2, 16, 16)
        torch.testing.assert_close(got[:, :10], want, atol=0, rtol=0)
        assert not got[:, 10:].any()


def test_supported_queries() -> None:
    q = torch.zeros(4, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    assert is_supported(q) and is_supported(q.half())
    assert not is_supported(q.float())  # fp32: the paged kernel keeps it
    assert not is_supported(torch.zeros(4, 8, 256, device=DEVICE, dtype=torch.bfloat16))


# On the GPU Llama-3-8B's heads at 1-5k tokens and the engine's bucket; in the interpreter a small
# twin in float16 (its tl.dot gets bfloat16 wrong).
HEADS, GPU_DTYPE, BUCKET = (
    ((4, 1, 32), torch.float16, 16) if INTERPRET else ((32, 8, 128), torch.bfloat16, None)
)
KERNEL_CASES = [(40, 40), (70, 25)] if INTERPRET else [(2500, 2500), (5000, 1500), (4608, 1024)]


@pytest.mark.parametrize("cache", ["bf16", "fp8 V token-major"])
@pytest.mark.parametrize(("context_len", "q_len"), KERNEL_CASES)
@pytest.mark.parametrize("views", [False, True], ids=["copies", "token-major views"])
def test_chunk_matches_the_paged_kernel(cache: str, context_len: int, q_len: int, views: bool) -> None:
    """Against the Triton kernel on the same cache (a 16-bit cache in q's dtype); q a view of a wider
    q / k / v product's rows, as the engine's is."""
    from pagoda.kernels.attention import paged_attention

    torch.manual_seed(q_len)
    (heads, kv_heads, dim), block_size = HEADS, 16
    num_blocks = context_len // block_size + 8
    dtype = GPU_DTYPE if cache == "bf16" else FP8
    k_cache, v_cache = _cache(num_blocks, block_size, kv_heads, dim, dtype, cache.endswith("token-major"))
    blocks = torch.randperm(num_blocks, device=DEVICE).to(torch.int32)
    q = torch.randn(q_len, heads + 2 * kv_heads, dim, device=DEVICE, dtype=GPU_DTYPE)[:, :heads]
    out = torch.empty(q.shape, device=DEVICE, dtype=GPU_DTYPE).fill_(float("nan"))
    chunk_attention(
        q, k_cache, v_cache, blocks, context_len, dim**-0.5, out, 1.0, 1.0, BUCKET, token_major=views
    )
    want = paged_attention(
        q, k_cache, v_cache, blocks[None],
        torch.tensor([context_len], dtype=torch.int32, device=DEVICE),
        torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE),
        dim**-0.5, q_len, context_len,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in float32 over q's own rows, GQA by repeating K and V's heads: [L, heads, dim]."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    scores = q.float().transpose(0, 1) @ k.transpose(1, 2) * scale  # [heads, L, L]
    mask = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool, device=q.device).triu(1)
    return (scores.masked_fill(mask, float("-inf")).softmax(-1) @ v).transpose(0, 1)


# (the prompt's tokens, the rows that follow it in the step): a bucket's worth past a whole bucket,
# rows past the prompt read from what follows (another prompt's rows, here large values), an exact bucket.
PROMPT_CASES = [(45, 7), (45, 40), (48, 0)] if INTERPRET else [(2048, 0), (2300, 300), (2600, 600)]


@pytest.mark.parametrize(("q_len", "after"), PROMPT_CASES)
def test_whole_prompt_on_its_own_rows_matches_causal_attention(q_len: int, after: int) -> None:
    """`prompt_attention` on the step's own token-major q, K and V: causal attention of the prompt alone,
    whatever the rows after it hold (the call reads them up to its bucket; the causal mask keeps every
    real query from them). On a GPU at Llama-3-8B's heads and the engine's bucket, in bf16."""
    torch.manual_seed(q_len + after)
    (heads, kv_heads, dim), bucket = HEADS, BUCKET or 512
    rows = -(-q_len // bucket) * bucket
    total = max(q_len + after, rows)
    q, k, v = (
        torch.randn(total, n, dim, device=DEVICE, dtype=GPU_DTYPE) for n in (heads, kv_heads, kv_heads)
    )
    for t in (k, v):
        t[q_len:] = 30.0  # what follows: seen by any real query, the output would show it
    out = torch.full((q_len, heads, dim), float("nan"), device=DEVICE, dtype=GPU_DTYPE)
    prompt_attention(q, k, v, q_len, dim**-0.5, out, BUCKET)
    want = _causal(q[:q_len], k[:q_len], v[:q_len], dim**-0.5)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="takes"):
        prompt_attention(q[: rows - 1], k, v, q_len, dim**-0.5, out, BUCKET)  # short of the bucket
    if rows > q_len:
        with pytest.raises(ValueError, match="takes"):
            prompt_attention(q, k, v, q_len, dim**-0.5, out[:-1], BUCKET)


@pytest.mark.parametrize("v_scale", [1.0, 1.7])
def test_merge_kernel_matches_its_reference(v_scale: float) -> None:
    """Both parts strided as cuDNN leaves them (a slice of padded rows, heads not outermost in memory),
    log-sum-exps far apart (one part dominates some rows), a ragged last tile (37 rows)."""
    from pagoda.kernels.lse_merge import merge_attention

    torch.manual_seed(3)
    heads, tokens, dim, dtype = 4, 37, 32, GPU_DTYPE
    a = torch.randn(tokens + 5, heads, dim, device=DEVICE, dtype=dtype).transpose(0, 1)[:, 2 : 2 + tokens]
    b = torch.randn(heads, tokens, dim, device=DEVICE, dtype=dtype)
    a_lse = torch.randn(tokens, heads, device=DEVICE).t() * 4
    b_lse = torch.randn(heads, tokens, device=DEVICE) * 4
    got = torch.full((tokens, heads, dim), float("nan"), device=DEVICE, dtype=dtype)
    want = torch.empty_like(got)
    merge_attention(got, a, a_lse, b, b_lse, v_scale)
    reference.merge_attention(want, a, a_lse, b, b_lse, v_scale)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2 * v_scale, rtol=1e-2)
