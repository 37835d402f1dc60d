"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts, prefix caching, copy-on-write.

No torch here: the block manager only decides which block ids hold which tokens; the model runner owns
the tensors. Prefix caching keys each *full* block by a chained hash of (previous block's hash, its
tokens) and keeps the tokens beside it, so a hash collision is detected and never corrupts output.
Freed blocks keep their hash and stay findable until they are reused (least recently freed first).
With `record_events`, what enters and leaves the prefix cache is kept as vLLM's KV-cache events
(kv_events.py) until the engine core publishes them after the step.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagoda.service.engine.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    external_hash,
)
from pagoda.service.engine.core.request import Request


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens a hashed block holds, checked on every hit


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._block_hashes: dict[str, list[int]] = {}  # request id -> chained hashes of its full blocks
        self._num_registered: dict[str, int] = {}  # request id -> its leading blocks seen by the cache
        # Counters for metrics and tests (tokens, not blocks).
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        self._events: list[KVCacheEvent] | None = [] if record_events else None

    def take_events(self) -> list[KVCacheEvent]:
        """The KV-cache events since the last call (none unless `record_events`)."""
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def _hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        hashes = self._block_hashes.setdefault(req.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            # Under a LoRA adapter the same tokens hold other K and V: its chain starts elsewhere.
            parent = hashes[-1] if hashes else (hash(("lora", req.lora_name)) if req.lora_name else 0)
            hashes.append(hash((parent, tuple(req.token_ids[i * bs : (i + 1) * bs]))))
        return hashes

    def _cached_prefix(self, req: Request) -> list[int]:
        """Block ids that already hold a prefix of `req`'s tokens. At least one token is left to
        compute, since the last one's logits are needed."""
        if not self.enable_prefix_caching or req.block_ids or req.params.prompt_logprobs is not None:
            return []  # (prompt log-probabilities need every prompt position computed)
        bs = self.block_size
        hits: list[int] = []
        for i, block_hash in enumerate(self._hashes(req, (req.num_tokens - 1) // bs)):
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            if self.blocks[block_id].token_ids != tuple(req.token_ids[i * bs : (i + 1) * bs]):
                break  # a hash collision: treat as a miss
            hits.append(block_id)
        return hits

    def num_cached_prefix_tokens(self, req: Request) -> int:
        """How many of a blockless request's first tokens the prefix cache already holds."""
        return len(self._cached_prefix(req)) * self.block_size

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Whether `num_new_tokens` more tokens of `req` fit; for a request with no blocks yet they
        are counted after its cached prefix."""
        bs = self.block_size
        if req.block_ids:
            start = req.num_computed_tokens
            needed = -(-(start + num_new_tokens) // bs) - len(req.block_ids)
            if start % bs and start // bs < len(req.block_ids):
                needed += self.blocks[req.block_ids[start // bs]].ref_count > 1  # copy on write
            return max(needed, 0) <= len(self._free)
        hits = self._cached_prefix(req)
        num_hits_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        needed = -(-(len(hits) * bs + num_new_tokens) // bs) - len(hits)
        return needed <= len(self._free) - num_hits_free

    # ---- mutations -----------------------------------------------------------------------------

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None and self._hash_to_block.get(block.block_hash) == block_id:
            del self._hash_to_block[block.block_hash]  # evicted from the prefix cache
            if self._events is not None:
                self._events.append(BlockRemoved([external_hash(block.block_hash)], "GPU"))
        block.block_hash = None
        block.token_ids = None
        block.ref_count = 1
        return block_id

    def allocate(self, req: Request, num_new_tokens: int) -> list[tuple[int, int]]:
        """Give `req` the blocks for its next `num_new_tokens` tokens.

        A request with no blocks first takes its cached prefix (advancing `num_computed_tokens`) and
        `num_new_tokens` counts from there.
        Returns copy-on-write operations `(src_block, dst_block)` the runner must apply first.
        Call only after `can_allocate` said yes.
        """
        if not req.block_ids:
            hits = self._cached_prefix(req)
            if self.enable_prefix_caching:
                self.prefix_queries_tokens += req.num_tokens - req.num_computed_tokens
                self.prefix_hits_tokens += len(hits) * self.block_size
            for block_id in hits:
                if self.blocks[block_id].ref_count == 0:
                    del self._free[block_id]
                self.blocks[block_id].ref_count += 1
            req.block_ids = list(hits)
            hit_tokens = len(hits) * self.block_size
            req.num_computed_tokens = hit_tokens
            req.num_cached_tokens = hit_tokens
        copies: list[tuple[int, int]] = []
        bs = self.block_size
        start = req.num_computed_tokens
        if start % bs and start // bs < len(req.block_ids):
            shared = req.block_ids[start // bs]
            if self.blocks[shared].ref_count > 1:
                fresh = self._take_free()
                self.blocks[shared].ref_count -= 1
                req.block_ids[start // bs] = fresh
                copies.append((shared, fresh))
        while len(req.block_ids) * bs < start + num_new_tokens:
            req.block_ids.append(self._take_free())
        return copies

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the full blocks whose tokens are all computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        start = self._num_registered.get(req.request_id, 0)
        if start >= num_full:
            return  # called every step: only a block that just filled is new (once in block_size steps)
        self._num_registered[req.request_id] = num_full
        hashes = self._hashes(req, num_full)
        bs = self.block_size
        stored: list[int] = []  # block indexes newly in the cache, in order
        for i in range(start, num_full):
            block = self.blocks[req.block_ids[i]]
            if block.block_hash is not None:
                continue
            if hashes[i] in self._hash_to_block:
                continue  # another block already holds these tokens
            block.block_hash = hashes[i]
            block.token_ids = tuple(req.token_ids[i * bs : (i + 1) * bs])
            self._hash_to_block[hashes[i]] = block.block_id
            stored.append(i)
        if self._events is not None and stored:
            self._record_stored(req, hashes, stored)

    def _record_stored(self, req: Request, hashes: list[int], stored: list[int]) -> None:
        """One BlockStored per run of consecutive blocks, its parent the block before the run."""
        bs = self.block_size
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        assert self._events is not None
        for run in runs:
            parent = external_hash(hashes[run[0] - 1]) if run[0] > 0 else None
            tokens = req.token_ids[run[0] * bs : (run[-1] + 1) * bs]
            chain = [external_hash(hashes[i]) for i in run]
            self._events.append(BlockStored(chain, parent, list(tokens), bs, None, "GPU", None))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's `LLM.reset_prefix_cache()`), so the next requests compute
        their prompts in full, as benchmarks that repeat prompts need. Only while no request holds a
        block: otherwise it forgets nothing and returns False."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        self._hash_to_block.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """`child` shares every block of `parent` (n > 1 after the shared prompt is computed)."""
        for block_id in parent.block_ids:
            self.blocks[block_id].ref_count += 1
        child.block_ids = list(parent.block_ids)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, req: Request) -> None:
        """Release `req`'s blocks. Hashed blocks stay findable at the back of the free queue (the
        prefix's tail first, so its head survives longest); unhashed ones are reused first."""
        for block_id in reversed(req.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)
        req.block_ids = []
        req.num_computed_tokens = 0
        self._block_hashes.pop(req.request_id, None)
        self._num_registered.pop(req.request_id, None)
