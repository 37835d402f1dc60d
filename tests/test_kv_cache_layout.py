"""The KV cache's one tensor and the views the layers index (`allocate_kv_cache`): its size per block
(`kv_block_bytes`, what the engine divides its memory budget by), each layer's K slot-major and V in
the layout asked for, bound to that layer's part of the tensor; copy-on-write of whole blocks."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.kv_cache import is_token_major
from pagoda.service.model.attention import PagedAttention, allocate_kv_cache, copy_kv_blocks, kv_block_bytes

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK, BLOCKS = 3, 4, 2, 8, 4, 5


def _layers() -> list[PagedAttention]:
    return [PagedAttention(HEADS, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("v_token_major", [False, True])
def test_each_layer_views_its_own_part_of_one_tensor(dtype: torch.dtype, v_token_major: bool) -> None:
    layers = _layers()
    cache = allocate_kv_cache(layers, BLOCKS, BLOCK, dtype, torch.device("cpu"), v_token_major)
    # Three layers (not two, where 2 * n == 2 ** n) and both element sizes.
    assert cache.numel() * cache.element_size() == BLOCKS * kv_block_bytes(
        LAYERS, BLOCK, KV_HEADS, HEAD_DIM, dtype
    )
    cache.zero_()
    for i, layer in enumerate(layers):
        assert layer.k_cache.shape == layer.v_cache.shape == (BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
        assert not is_token_major(layer.k_cache)
        assert is_token_major(layer.v_cache) == v_token_major
        # A value written through the views lands in this layer's K (or V) row of the block.
        layer.k_cache[2, 1, 1, 3] = i + 1
        layer.v_cache[3, 2, 0, 5] = -(i + 1)
        assert cache[0, i, 2, (1 * KV_HEADS + 1) * HEAD_DIM + 3] == i + 1
        slot = (0 * HEAD_DIM + 5) * BLOCK + 2 if v_token_major else (2 * KV_HEADS + 0) * HEAD_DIM + 5
        assert cache[1, i, 3, slot] == -(i + 1)
    assert int((cache != 0).sum()) == 2 * LAYERS


def test_copy_on_write_copies_a_block_s_k_and_v_in_every_layer() -> None:
    layers = _layers()
    cache = allocate_kv_cache(layers, BLOCKS, BLOCK, torch.float32, torch.device("cpu"), True)
    cache.copy_(torch.randn(cache.shape))
    before = cache.clone()
    copy_kv_blocks(cache, [(1, 4), (3, 0)])
    assert torch.equal(cache[:, :, 4], before[:, :, 1]) and torch.equal(cache[:, :, 0], before[:, :, 3])
    assert torch.equal(cache[:, :, 1:4], before[:, :, 1:4])  # the sources and the untouched block
    assert not torch.equal(before[:, :, 4], before[:, :, 1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_cache_is_zeroed_not_left_as_the_allocator_found_it(dtype: torch.dtype) -> None:
    """The decode kernel reads the slots past a context's end (`DecodeConfig.finite_cache`): a fresh
    cache must hold no NaN. Memory just freed full of NaN is what the allocator hands back next (a
    small buffer reuses the freed one)."""
    shape = (2, LAYERS, BLOCKS, BLOCK * KV_HEADS * HEAD_DIM)
    torch.full(shape, float("nan"), dtype=torch.float32).to(dtype)  # freed at once, NaN in its bytes
    cache = allocate_kv_cache(_layers(), BLOCKS, BLOCK, dtype, torch.device("cpu"), True)
    assert cache.shape == shape and cache.view(torch.uint8).eq(0).all()
