"""Continuous batching: every step, fill a token budget from running requests first, then waiting ones.

One rule for everything: a scheduled request computes `min(num_tokens - num_computed_tokens, budget)`
tokens. A decode row is 1 token, a prefill row is the prompt, a long prompt is split across steps,
and a preempted request simply recomputes. When blocks run out, the newest running request is
preempted (its blocks freed, put back at the head of the queue). No torch here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pagoda.service.engine.core.block_manager import BlockManager
from pagoda.service.engine.core.lora_slots import LoRASlots
from pagoda.service.engine.core.request import PLACEHOLDER, Request, RequestStatus

# Prompt tokens a step may score for `prompt_logprobs`, over all its requests. Each scored row costs the
# runner ~10 bytes a vocabulary entry at once (the LM head's 16-bit row, its float32 copy, the
# log-softmax): an 8k-token chunk at Llama-3's 128k vocabulary would ask for ~10 GB beside the KV cache.
# 512 rows: ~0.66 GB there. A long prompt's scores take more steps (a 32k prompt 64), not more memory.
PROMPT_SCORE_TOKENS = 512


@dataclass
class GrammarBitmask:
    """The tokens the grammars allow in one step: row k of `bitmask` (int32 words; bit t of a row: token
    t allowed) belongs to row `rows[k]` (of the step's batch in the core, of the sampled rows in the
    sampler). Rows without a grammar have no row here. A sequence that drafted k tokens has k + 1
    rows, one per verified position: `positions[k]` is a row's (empty: every row at position 0)."""

    rows: list[int]
    bitmask: np.ndarray
    positions: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """What the model runner computes this step, in batch order."""

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    copy_ops: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) KV blocks, before the step
    lora_loads: list[tuple[int, str, str]] = field(default_factory=list)  # (slot, name, path), before it

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    def needs_sample(self, i: int) -> bool:
        """Whether row `i` reaches the end of its tokens this step, so its next token is sampled."""
        req = self.requests[i]
        return req.num_computed_tokens + self.num_scheduled_tokens[i] == req.num_tokens


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_mixed_prefill_tokens: int = 0,
        lora_slots: LoRASlots | None = None,
        max_prompt_score_tokens: int = PROMPT_SCORE_TOKENS,
    ) -> None:
        self.block_manager = block_manager
        self.lora_slots = lora_slots  # with --enable-lora: the adapters' GPU slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Prefill tokens a step may add beside running decodes (0: the whole step budget). Every stream
        # waits for the step, so this bounds the gap new prompts open in the others' token streams.
        self.max_mixed_prefill_tokens = max_mixed_prefill_tokens
        self.max_prompt_score_tokens = max_prompt_score_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def _budget_for(self, req: Request, budget: int) -> int:
        num_new = min(req.num_tokens - req.num_computed_tokens, budget)
        if req.pending_forks:
            num_new = min(num_new, req.fork_point - req.num_computed_tokens)
        return num_new

    @staticmethod
    def _scores_prompt(req: Request, num_computed: int) -> bool:
        """Whether the request's next tokens include prompt positions scored for `prompt_logprobs`."""
        return req.params.prompt_logprobs is not None and num_computed < req.num_prompt_tokens - 1

    def _fork(self, leader: Request, position: int) -> None:
        """Siblings join right after the leader, sharing its blocks (copy on write later)."""
        for offset, child in enumerate(leader.pending_forks, start=1):
            self.block_manager.fork(leader, child)
            child.status = RequestStatus.RUNNING
            child.lora_slot = leader.lora_slot
            self.running.insert(position + offset, child)
        leader.pending_forks = []

    def _preempt(self, req: Request) -> None:
        req.drop_drafts()
        self.block_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        preempted = False
        prefill_budget = budget
        cap = self.max_mixed_prefill_tokens  # (the scan for decodes runs only when a cap is set)
        if cap and any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running):
            prefill_budget = cap
        score_budget = self.max_prompt_score_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.pending_forks and req.num_computed_tokens == req.fork_point:
                self._fork(req, i)
            num_new = self._budget_for(req, budget)
            if req.num_drafts and num_new < 1 + req.num_drafts:  # no room for its drafts: decode alone
                req.drop_drafts()
                num_new = 1
            if num_new > 1 and not req.num_drafts:  # a prompt chunk (or a recompute), not a decode
                num_new = min(num_new, prefill_budget)
                if num_new == 0:
                    i += 1
                    continue
                if self._scores_prompt(req, req.num_computed_tokens):
                    num_new = min(num_new, score_budget)
                    if num_new == 0:
                        i += 1
                        continue
                    score_budget -= num_new
                prefill_budget -= num_new
            while not bm.can_allocate(req, num_new):
                if req.num_drafts:  # drafts give way before any sequence is preempted
                    req.drop_drafts()
                    num_new = 1
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                out.copy_ops += bm.allocate(req, num_new)
                out.requests.append(req)
                out.num_scheduled_tokens.append(num_new)
                budget -= num_new
                i += 1
                continue
            break  # `req` itself was preempted: nothing newer is left to schedule

        # Admit waiting requests unless this step had to preempt.
        passed: list[Request] = []  # waiting for an adapter slot: the ones behind go first meanwhile
        while self.waiting and min(budget, prefill_budget) > 0 and len(self.running) < self.max_num_seqs:
            if preempted:
                break  # memory is tight
            req = self.waiting[0]
            if req.lora_name is not None and not self._place_adapter(req):
                passed.append(self.waiting.popleft())
                continue
            num_cached = bm.num_cached_prefix_tokens(req)
            num_new = min(req.num_tokens - num_cached, budget, prefill_budget)
            if req.pending_forks:
                num_new = min(num_new, req.fork_point - num_cached)
            scores = self._scores_prompt(req, num_cached)
            if scores:
                num_new = min(num_new, score_budget)
                if num_new == 0:
                    break  # in arrival order: the next step scores it
            if not bm.can_allocate(req, num_new):
                break
            self.waiting.popleft()
            out.copy_ops += bm.allocate(req, num_new)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if num_new == 0:  # the cache holds everything up to the fork point
                self._fork(req, len(self.running) - 1)
                continue  # the leader and its siblings are scheduled from the next step on
            out.requests.append(req)
            out.num_scheduled_tokens.append(num_new)
            budget -= num_new
            prefill_budget -= num_new
            if scores:
                score_budget -= num_new
        self.waiting.extendleft(reversed(passed))
        if self.lora_slots is not None:
            out.lora_loads = self.lora_slots.take_loads()
        return out

    def _place_adapter(self, req: Request) -> bool:
        """Give `req` its adapter's slot; False when the running requests hold every slot."""
        assert self.lora_slots is not None and req.lora_name is not None
        in_use = {r.lora_name for r in self.running if r.lora_name is not None}
        slot = self.lora_slots.place(req.lora_name, in_use)
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def advance(self, out: SchedulerOutput) -> list[Request]:
        """Advance the computed counts once the runner has `out` (queued, or done); each request that
        samples gets a `PLACEHOLDER` token, which its owner replaces with the sampled one (one that
        drafted gets none: its owner keeps the accepted drafts and appends the sampled token).

        The next step can be scheduled before that: its input for the placeholder comes from the device.
        Returns the requests that sample, in batch order (those finished meanwhile are skipped)."""
        grew = []
        for i, (req, num_new) in enumerate(zip(out.requests, out.num_scheduled_tokens, strict=True)):
            if req.status is not RequestStatus.RUNNING:
                continue  # finished (aborted, stopped) since it was scheduled
            samples = out.needs_sample(i)
            req.num_computed_tokens += num_new
            if req.num_drafts:  # its blocks are cached once the verifier has said which drafts stay
                grew.append(req)
                continue
            self.block_manager.cache_computed_blocks(req)
            if samples:
                req.token_ids.append(PLACEHOLDER)
                grew.append(req)
        return grew

    def finish(self, req: Request) -> None:
        """Remove `req` wherever it is and free its blocks (done, stopped or aborted)."""
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        for child in req.pending_forks:
            child.status = RequestStatus.FINISHED
        req.pending_forks = []
        self.block_manager.free(req)
        req.status = RequestStatus.FINISHED
