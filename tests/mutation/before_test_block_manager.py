"""The KV block manager on its own: allocation, reference counts, prefix caching, copy on write."""

from __future__ import annotations

from pagoda.service.engine.block_manager import BlockManager
from pagoda.service.engine.request import Request
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
