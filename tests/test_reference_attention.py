"""The reference attention (the engine's CPU path) never reads what nobody wrote."""

from __future__ import annotations

import torch

from pagoda.kernels import reference


def test_decode_rows_of_different_lengths_ignore_unwritten_slots() -> None:
    """A short decode row batched with a long one gathers slots past its end; the cache there holds
    whatever the allocator left (here NaN), which must not reach the output."""
    torch.manual_seed(0)
    num_blocks, block_size, heads, kv_heads, dim = 8, 4, 4, 2, 16
    k_cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    lens = [3, 13]  # the short row's block holds one unwritten slot; the long row spans 4 blocks
    tables = torch.tensor([[5, 0, 0, 0], [1, 2, 3, 4]], dtype=torch.int32)
    for row, n in enumerate(lens):
        for pos in range(n):
            block, offset = int(tables[row, pos // block_size]), pos % block_size
            k_cache[block, offset] = torch.randn(kv_heads, dim)
            v_cache[block, offset] = torch.randn(kv_heads, dim)
    q = torch.randn(2, heads, dim)
    out = reference.paged_attention(
        q,
        k_cache,
        v_cache,
        tables,
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor([0, 1, 2], dtype=torch.int32),
        dim**-0.5,
        max_query_len=1,
        max_seq_len=max(lens),
    )
    assert torch.isfinite(out).all()
    # Row 0 alone gives the same answer.
    alone = reference.paged_attention(
        q[:1],
        k_cache,
        v_cache,
        tables[:1],
        torch.tensor(lens[:1], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
        dim**-0.5,
        max_query_len=1,
        max_seq_len=lens[0],
    )
    torch.testing.assert_close(out[:1], alone)
