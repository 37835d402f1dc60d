"""One sequence being generated: its tokens, how many have KV in the cache, and its blocks."""

from __future__ import annotations

import enum

from pagoda.service.sampling_params import SamplingParams

# A sampled token the host has not read yet (the core queues the next step before it does). Never a
# real token id; nothing hashes, shows or penalises it: the step's owner overwrites it first.
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # back in the waiting queue, its KV freed; recomputed when rescheduled
    FINISHED = enum.auto()


class Request:
    """A single sequence. A client request with n > 1 becomes n of these that share the prompt.

    The one scheduling rule: each step computes `num_tokens - num_computed_tokens` more tokens (capped
    by the token budget); prefill, chunked prefill, decode and recompute after preemption are all that.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        index: int = 0,
        lora_name: str | None = None,
    ) -> None:
        self.request_id = request_id  # unique per sequence: "<client id>" or "<client id>#<index>"
        self.index = index  # which of the client's n completions
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first schedule
        self.block_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.arrival_time = arrival_time
        self.num_preemptions = 0
        # Siblings (n > 1) wait for this leader to compute the shared prompt, then fork from it.
        self.pending_forks: list[Request] = []
        # Speculative decoding: the last `num_drafts` of `token_ids` are drafts (core/speculation.py),
        # computed with the real last token in one step and kept only as far as the verifier accepts.
        self.num_drafts = 0
        self.draft_proposal: list[int] = []  # what the lookup at its last token found (prompt lookup)
        self.wants_draft = False  # whether it drafts at the next step (its lookup found one; a draft model)
        self.draft_misses = 0  # misses in a row: lookups that found nothing, drafts rejected whole
        self.draft_pause = 0  # lookups to skip (after misses)
        self.lora_name = lora_name  # the LoRA adapter it runs under (None: the base model)
        self.lora_slot = -1  # the adapter's GPU slot while it runs (core/lora_slots.py)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_drafts :]

    def add_drafts(self, tokens: list[int]) -> None:
        self.token_ids += tokens
        self.num_drafts += len(tokens)

    def drop_drafts(self, keep: int = 0) -> None:
        """Keep the first `keep` drafts as real tokens (accepted), drop the rest; computed counts that
        covered the dropped ones fall back to the kept tokens."""
        end = len(self.token_ids) - self.num_drafts + keep
        del self.token_ids[end:]
        self.num_computed_tokens = min(self.num_computed_tokens, end)
        self.num_drafts = 0

    @property
    def fork_point(self) -> int:
        """Siblings fork once the leader has computed all prompt tokens but the last, whose logits
        each sibling computes itself (so each samples its own first token)."""
        return self.num_prompt_tokens - 1

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.name})"
        )
