"""The KV block manager on its own: allocation, reference counts, prefix caching, copy on write."""

from __future__ import annotations

import pytest

from pagoda.service.engine.core.block_manager import BlockManager
from pagoda.service.engine.core.request import Request
from pagoda.service.sampling_params import SamplingParams


def make(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, SamplingParams(), arrival_time=0.0)


def compute(bm: BlockManager, req: Request, num_new: int) -> None:
    """What the scheduler and runner do for one step of `num_new` tokens."""
    assert bm.can_allocate(req, num_new)
    bm.allocate(req, num_new)
    req.num_computed_tokens += num_new
    bm.cache_computed_blocks(req)


def test_allocate_and_free_return_every_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make(list(range(10)))
    compute(bm, req, 10)
    assert len(req.block_ids) == 3 and bm.num_free_blocks == 5
    req.token_ids.append(99)
    compute(bm, req, 1)  # position 10 still fits in the third block
    assert len(req.block_ids) == 3
    bm.free(req)
    assert bm.num_free_blocks == 8 and all(b.ref_count == 0 for b in bm.blocks)


def test_can_allocate_refuses_when_full() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.can_allocate(make(list(range(8))), 8)
    assert not bm.can_allocate(make(list(range(9))), 9)


def test_prefix_cache_shares_full_blocks_and_leaves_one_token() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make(list(range(12)), "a")
    compute(bm, first, 12)
    second = make([*range(12), 50, 51], "b")
    assert bm.num_cached_prefix_tokens(second) == 12
    bm.allocate(second, 2)
    assert second.num_computed_tokens == 12 and second.block_ids[:3] == first.block_ids
    assert all(bm.blocks[b].ref_count == 2 for b in first.block_ids)
    # The same 12 tokens again: the last block is recomputed so its logits exist.
    third = make(list(range(12)), "c")
    assert bm.num_cached_prefix_tokens(third) == 8


def test_decode_registers_each_block_once_it_fills_and_again_after_preemption() -> None:
    """Blocks are registered as they fill, one step at a time, and a request freed (preempted) and
    computed again registers its blocks anew."""
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make(list(range(6)), "a")
    compute(bm, req, 6)
    assert bm.num_cached_prefix_tokens(make(list(range(9)), "probe1")) == 4  # one full block so far
    for token in (6, 7, 8):  # decode: position 7 fills the second block
        req.token_ids.append(token)
        compute(bm, req, 1)
    assert bm.num_cached_prefix_tokens(make(list(range(9)), "probe2")) == 8
    bm.free(req)  # preempted: its blocks are free but findable; it recomputes with new blocks
    assert bm.reset_prefix_cache()  # forget them, as if other requests had taken those blocks
    compute(bm, req, len(req.token_ids))
    assert bm.num_cached_prefix_tokens(make([*range(9), 100], "probe3")) == 8


def test_reset_prefix_cache_forgets_only_when_no_request_holds_a_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make(list(range(9)), "a")
    compute(bm, a, 9)
    assert not bm.reset_prefix_cache()  # `a` still holds its blocks: nothing forgotten
    assert bm.num_cached_prefix_tokens(make(list(range(9)), "probe1")) == 8
    bm.free(a)
    assert bm.num_cached_prefix_tokens(make(list(range(9)), "probe2")) == 8  # freed, still findable
    assert bm.reset_prefix_cache()
    assert bm.num_cached_prefix_tokens(make(list(range(9)), "probe3")) == 0
    b = make(list(range(9)), "b")
    compute(bm, b, 9)  # computed in full, and cached again
    assert b.block_ids and bm.num_cached_prefix_tokens(make(list(range(9)), "probe4")) == 8


def test_freed_blocks_stay_findable_until_reused() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make(list(range(9)), "a")
    compute(bm, a, 9)
    bm.free(a)
    b = make(list(range(9)), "b")
    assert bm.num_cached_prefix_tokens(b) == 8
    # Fill the cache with other tokens: the old blocks get evicted.
    c = make(list(range(100, 116)), "c")
    compute(bm, c, 16)
    assert bm.num_cached_prefix_tokens(b) == 0


def test_hash_collision_is_a_miss_not_corruption() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make([1, 2, 3, 4, 5], "a")
    compute(bm, a, 5)
    # Forge a collision: the cached block claims other tokens than it holds.
    block = bm.blocks[a.block_ids[0]]
    block.token_ids = (9, 9, 9, 9)
    b = make([1, 2, 3, 4, 5], "b")
    assert bm.num_cached_prefix_tokens(b) == 0


def test_fork_shares_then_copies_on_write() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make(list(range(6)), "p")
    compute(bm, parent, 5)  # up to the fork point
    child = make(list(range(6)), "c")
    bm.fork(parent, child)
    assert child.block_ids == parent.block_ids
    assert bm.blocks[parent.block_ids[1]].ref_count == 2
    assert bm.can_allocate(child, 1)
    copies = bm.allocate(child, 1)  # writes position 5 into the shared partial block
    assert copies == [(parent.block_ids[1], child.block_ids[1])]
    assert child.block_ids[0] == parent.block_ids[0] and child.block_ids[1] != parent.block_ids[1]
    assert bm.allocate(parent, 1) == []  # the parent now owns its block alone
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_a_block_is_its_tokens_and_everything_before_them() -> None:
    """A cached block is keyed by its whole prefix: the same four tokens at another offset, or after
    other blocks, hold other KV (positions, attention context) and must never hit."""
    bm = BlockManager(num_blocks=16, block_size=4)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    a = make([*x, *y, *z, 0], "a")
    compute(bm, a, 13)
    assert bm.num_cached_prefix_tokens(make([*x, *y, *z, 99], "same")) == 12
    assert bm.num_cached_prefix_tokens(make([*y, *z, 99], "shifted")) == 0  # y at offset 0, not 4
    assert bm.num_cached_prefix_tokens(make([*z, 99], "z first")) == 0
    assert bm.num_cached_prefix_tokens(make([*x, *z, 99], "skips y")) == 4  # x only: z after x is new
    assert bm.num_cached_prefix_tokens(make([13, 14, 15, 16, *y, *z, 99], "other head")) == 0


def test_a_prefix_registered_by_a_finished_request_is_found_by_the_next() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make(list(range(9)), "a")
    compute(bm, a, 9)
    held = list(a.block_ids)
    bm.free(a)
    b = make([*range(8), 42], "b")
    assert bm.num_cached_prefix_tokens(b) == 8
    bm.allocate(b, 1)
    assert b.block_ids[:2] == held[:2] and b.num_computed_tokens == 8


def test_usage_and_the_size_check() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.usage == 0.0
    compute(bm, make(list(range(10)), "a"), 10)  # 3 blocks
    assert bm.num_free_blocks == 5 and bm.usage == 3 / 8
    assert BlockManager(num_blocks=1, block_size=4).num_free_blocks == 1
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(num_blocks=0, block_size=4)


def test_can_allocate_counts_exactly_the_blocks_a_running_request_still_needs() -> None:
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    req = make(list(range(20)), "a")
    compute(bm, req, 5)  # 5 tokens in 2 blocks, 1 block free
    assert bm.can_allocate(req, 3)  # up to 8 tokens: no new block
    assert bm.can_allocate(req, 7)  # 12 tokens: the free block
    assert not bm.can_allocate(req, 8)  # 13 tokens: a fourth block
    compute(bm, req, 3)
    other = make(list(range(100, 104)), "b")
    compute(bm, other, 4)  # takes the last block
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate(req, 1)  # 9 tokens need a third block
    partial = make(list(range(200, 210)), "c")
    bm2 = BlockManager(num_blocks=1, block_size=4, enable_prefix_caching=False)
    compute(bm2, partial, 2)
    assert bm2.num_free_blocks == 0 and bm2.can_allocate(partial, 2)  # room left in its own block


def test_copy_on_write_needs_a_block_only_while_the_block_is_shared() -> None:
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    parent = make([1, 2, 3, 4, 5, 6], "p")
    compute(bm, parent, 6)  # 2 blocks, the second half full: nothing free
    child = make([1, 2, 3, 4, 5, 6], "c")
    bm.fork(parent, child)
    assert not bm.can_allocate(child, 1)  # writing into the shared half block copies it first
    bm.free(parent)
    assert bm.num_free_blocks == 0  # the child still holds both
    assert bm.can_allocate(child, 1)  # its own now: written in place
    assert bm.allocate(child, 1) == []


def test_cached_blocks_that_are_free_still_count_against_the_free_list() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make(list(range(9)), "a")
    compute(bm, a, 9)
    bm.free(a)  # 4 free, 2 of them holding a's cached prefix
    assert bm.can_allocate(make([*range(8), *range(50, 55)], "b"), 5)  # 13 tokens: 2 hits + 2 new
    assert not bm.can_allocate(make([*range(8), *range(50, 59)], "c"), 9)  # 17 tokens: 3 new, 2 left
    b = make([*range(8), *range(50, 55)], "b")
    bm.allocate(b, 5)
    assert bm.num_free_blocks == 0  # the two hits left the free list and two more were taken
    assert [bm.blocks[i].ref_count for i in b.block_ids] == [1, 1, 1, 1]
    assert (bm.prefix_queries_tokens, bm.prefix_hits_tokens) == (9 + 13, 8)  # a asked for 9, hit none


def test_freed_blocks_without_a_hash_are_reused_first() -> None:
    """An unhashed block freed after a cached prefix still goes before it in the free queue."""
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make(list(range(8)), "a")  # two full, hashed blocks
    compute(bm, a, 8)
    b = make([60, 61, 62], "b")  # one partial, unhashed block
    compute(bm, b, 3)
    bm.free(a)
    bm.free(b)
    assert a.num_computed_tokens == 0 and a.block_ids == []
    compute(bm, make([70, 71, 72], "other"), 3)  # must take b's block, not a's
    assert bm.num_cached_prefix_tokens(make([*range(8), 99], "again")) == 8


def test_a_block_after_a_shared_one_is_cached_too() -> None:
    """b takes a's first block from the cache and computes its own second one: that one is registered as
    well, and a third request that shares b's second block finds both."""
    bm = BlockManager(num_blocks=16, block_size=4)
    x, y, q = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    compute(bm, make([*x, *y, 0], "a"), 9)
    b = make([*x, *q, 0], "b")
    assert bm.can_allocate(b, 5)
    bm.allocate(b, 5)
    b.num_computed_tokens += 5
    bm.cache_computed_blocks(b)
    assert bm.num_cached_prefix_tokens(make([*x, *q, 99], "c")) == 8
    assert bm.num_cached_prefix_tokens(make([*x, *y, 99], "d")) == 8


def test_a_collision_with_any_other_tokens_is_a_miss() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make([5, 6, 7, 8, 9], "a")
    compute(bm, a, 5)
    bm.blocks[a.block_ids[0]].token_ids = (0, 0, 0, 0)  # sorts before the real tokens
    assert bm.num_cached_prefix_tokens(make([5, 6, 7, 8, 9], "b")) == 0
