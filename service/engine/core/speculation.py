"""Speculative decoding by prompt lookup (n-gram), on the core's side: which sequences draft, how many
tokens, and what the drafts are. No torch: the drafts ride in a sequence's `token_ids` through one
forward pass of k + 1 rows, and the runner's verifier (runner/spec_verify.py) says how many to keep.

Prompt lookup (Saxena, 2023; vLLM's `ngram` method): the last n tokens of a sequence (n from
`prompt_lookup_max` down to `prompt_lookup_min`) are looked up in its earlier tokens, and the tokens
that followed a match (the most recent with k tokens after it) are the draft. It costs no model and
pays where output copies input: code edits, RAG answers, summaries, structured data.

When a lookup runs. Each sequence's suffix is looked up as its step's tokens arrive, and a step drafts
(running in turn) only when some lookup found a draft, so async scheduling keeps its overlap while
nothing repeats. A miss (a lookup that finds nothing, or a draft rejected whole) pauses the sequence's
lookups: after m misses in a row it skips its next min(2^m, `MAX_PAUSE`) lookups, so output that never
repeats costs a lookup now and then, not every token. (A draft model's sequences never pause: `judged`.)

The load rule. A decode step is bound by reading the weights while the batch is small, so k more rows
per sequence cost little there, and by compute once it is large, where every rejected draft is paid
in full. A step therefore drafts at most `max_batch_tokens` rows in all: with B sequences decoding each
drafts `min(k, max_batch_tokens // B - 1)` tokens, and from B > max_batch_tokens / 2 on nobody drafts
and the step is an ordinary decode step (async scheduling included). A step that drafts runs in turn:
the drafts are read from the tokens the step before sampled.

Measured, not assumed (`adaptive`, on by default). What a drafting step costs against a decode step
depends on the GPU, the model, the kernels a step of k + 1 rows per sequence runs (on one H200 an 8B
model's 4-row drafting step took 8.8 ms against a 4.8 ms decode step, 128 rows 18.7 ms against 8.6
at batch 64) and on how many drafts are kept. So the core times its decode steps by batch size (in
power-of-two buckets), drafting and plain, as output tokens per second, and drafts at a batch size
only while drafting steps there are at least as fast; a bucket that stopped drafting drafts one step
in `EXPLORE_EVERY` still, so its figure follows the traffic (a copy-heavy stretch starts, a model
warms up). This is what vLLM leaves to a static config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pagoda.service.engine.config import SpeculativeConfig
from pagoda.service.engine.core.request import Request

MAX_PAUSE = 8  # lookups
EXPLORE_EVERY = 32  # steps at a batch size where drafting was measured slower: one still drafts
_RATE_WEIGHT = 0.2  # weight of the newest step in a bucket's moving average

# A draft model's proposer: `k[i]` greedy tokens after each sequence's last token.
ProposeDrafts = Callable[[list[Request], list[int]], list[list[int]]]
ValidDrafts = Callable[[Request, list[int]], int]  # how many of the drafts a sequence's grammar allows


def propose_ngram(token_ids: list[int], k: int, lookup_max: int, lookup_min: int) -> list[int]:
    """Up to `k` tokens that followed an earlier occurrence of the sequence's last n tokens (the most
    recent with k tokens after it), trying the longest n first; [] when no suffix of at least
    `lookup_min` tokens recurs."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        suffix = tokens[length - n :]
        # Windows that start at 0 .. length - n - 1: every occurrence before the suffix itself.
        starts = np.flatnonzero(tokens[: length - n] == suffix[0])
        for offset in range(1, n):
            if not len(starts):
                break
            starts = starts[tokens[starts + offset] == suffix[offset]]
        if len(starts):
            # The most recent match with k tokens after it; else the earliest, which has the most (in a
            # run of one token the most recent match overlaps the suffix and leaves one token to draft).
            full = starts[starts + n + k <= length]
            follow = int(full[-1] if len(full) else starts[0]) + n
            return [int(t) for t in tokens[follow : follow + k]]
    return []


def drafts_per_sequence(config: SpeculativeConfig, num_decoding: int) -> int:
    """The load rule: how many tokens each of `num_decoding` sequences may draft this step (0: none)."""
    if num_decoding < 1:
        return 0
    return max(0, min(config.num_speculative_tokens, config.max_batch_tokens // num_decoding - 1))


@dataclass
class SpecStats:
    """vLLM's spec-decode counters: drafts (sequences that drafted in a step), draft tokens, accepted
    tokens, and accepted tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def count(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position += [0] * (num_drafted - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


class StepRates:
    """Output tokens per second of pure decode steps (no prompt chunk), by batch-size bucket: those
    that drafted and those that did not, as exponential moving averages. The core times a step from
    the completion of the step before it to its own (engine_core.py says why)."""

    def __init__(self) -> None:
        self._rates: dict[tuple[int, bool], float] = {}
        self._declined: dict[int, int] = {}  # bucket -> steps it declined to draft since it last drafted

    @staticmethod
    def bucket(batch: int) -> int:
        return batch.bit_length()  # 1, 2-3, 4-7, ...

    def record(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        key = (self.bucket(batch), drafted)
        rate = tokens / seconds
        old = self._rates.get(key)
        self._rates[key] = rate if old is None else old + _RATE_WEIGHT * (rate - old)

    def rate(self, batch: int, drafted: bool) -> float | None:
        return self._rates.get((self.bucket(batch), drafted))

    def worth_drafting(self, batch: int) -> bool:
        """Whether a step of `batch` decoding sequences should draft: while drafting is unmeasured, not
        while plain steps are (a stream whose every lookup finds a draft, or a draft model's, must still
        learn what a plain step costs), when drafting is the faster, and one step in EXPLORE_EVERY of the
        others."""
        b = self.bucket(batch)
        drafting, plain = self._rates.get((b, True)), self._rates.get((b, False))
        if drafting is None:
            return True
        if plain is None:
            return False
        if drafting >= plain:
            self._declined.pop(b, None)
            return True
        declined = self._declined.get(b, 0) + 1
        self._declined[b] = declined % EXPLORE_EVERY
        return declined == EXPLORE_EVERY


class Speculator:
    """Looks a sequence's suffix up as each of its tokens arrives (`after_token`), drafts before a step
    for the sequences whose lookup found something (`plan`, `draft`), and keeps the books after it."""

    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        propose: ProposeDrafts | None = None,
        valid_drafts: ValidDrafts | None = None,
    ) -> None:
        """`propose`: a draft model's drafts (the executor's), for `config.method == "draft_model"`;
        `valid_drafts`: how many of a sequence's drafts its grammar allows (structured output's), for
        prompt lookup: without it grammar requests do not draft."""
        if (config.method == "draft_model") != (propose is not None):
            raise ValueError("a draft model's speculator takes its proposer, and only it")
        self.config = config
        self.max_model_len = max_model_len
        self.propose = propose
        self.valid_drafts = valid_drafts if propose is None else None
        self.stats = SpecStats()
        self.rates = StepRates()
        self.lookups = 0  # suffix lookups run (each costs a pass over the sequence's tokens)

    def after_token(self, req: Request, num_running: int) -> None:
        """A sequence got its tokens of a step (the last one real, not a placeholder): look its suffix
        up, unless it pauses or the batch is too large to draft (the load rule); a lookup that finds
        nothing counts as a miss."""
        req.draft_proposal, req.wants_draft = [], False
        if drafts_per_sequence(self.config, num_running) == 0 or not can_draft(req):
            return
        if req.params.grammar is not None and self.valid_drafts is None:
            return
        if req.draft_pause:
            req.draft_pause -= 1
            return
        if self.propose is not None:  # the draft model drafts after scheduling
            req.wants_draft = True
            return
        cfg = self.config
        self.lookups += 1
        req.draft_proposal = propose_ngram(
            req.token_ids, cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min
        )
        req.wants_draft = bool(req.draft_proposal)
        if not req.draft_proposal:
            self._missed(req)

    def plan(self, running: list[Request]) -> bool:
        """Before a step is scheduled: whether it drafts (someone's last lookup found a draft, and the
        load rule allows it). A step that drafts runs in turn, so this costs async scheduling's overlap
        only when a draft is likely."""
        decoding = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        if drafts_per_sequence(self.config, decoding) == 0 or not any(r.wants_draft for r in running):
            return False
        return not self.config.adaptive or self.rates.worth_drafting(decoding)

    def draft(self, running: list[Request]) -> int:
        """Append to the token ids of the decoding sequences the drafts their last lookup found (the
        step before has been completed: the lookups saw its tokens), cut to the load rule's length, to
        max_tokens and to the context; returns how many sequences drafted."""
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        k = drafts_per_sequence(self.config, len(decoding))
        drafted = 0
        for req in decoding:
            proposal, req.draft_proposal = req.draft_proposal, []
            wants, req.wants_draft = req.wants_draft, False
            # Never past max_tokens nor the context: the last kept row samples one more token.
            room = self.max_model_len - req.num_tokens - 1
            if req.params.max_tokens is not None:
                room = min(room, req.params.max_tokens - req.num_output_tokens - 1)
            length = max(min(k, room), 0)
            # A draft model's tokens come after scheduling (`fill`): until then its slots hold zeros.
            tokens = [0] * length if self.propose is not None and wants else proposal[:length]
            if tokens and req.params.grammar is not None:
                assert self.valid_drafts is not None  # after_token looked up nothing otherwise
                tokens = tokens[: self.valid_drafts(req, tokens)]
            if tokens:
                req.add_drafts(tokens)
                drafted += 1
        return drafted

    def fill(self, scheduled: list[Request]) -> None:
        """A draft model: the scheduled sequences' drafts, written over the zeros `draft` put there
        (the scheduler has allocated their slots, which the draft model's own KV cache writes)."""
        drafting = [r for r in scheduled if r.num_drafts]
        if self.propose is None or not drafting:
            return
        for req, tokens in zip(
            drafting, self.propose(drafting, [r.num_drafts for r in drafting]), strict=True
        ):
            req.token_ids[req.num_tokens - req.num_drafts :] = tokens

    def judged(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """Count a verified draft; under prompt lookup a draft of which nothing was kept is a miss. A
        draft model's sequences never pause: its proposal rounds cost a step about as much for one
        sequence as for all (each round reads the draft's weights), so a paused sequence would only
        take tokens from the steps that still draft (on one H100, draft = target at batch 32 drafted
        for ~20 of 32 sequences a step by the end-to-end figures, at a full drafting step's cost). Whether
        steps draft at all is the measured rule's."""
        self.stats.count(num_drafted, num_accepted)
        if num_accepted:
            req.draft_misses = 0
        elif self.propose is None:
            self._missed(req)

    @staticmethod
    def _missed(req: Request) -> None:
        """After m misses in a row (lookups that found nothing, drafts rejected whole) a sequence
        skips its next min(2^m, MAX_PAUSE) lookups."""
        req.draft_misses += 1
        req.draft_pause = min(2**req.draft_misses, MAX_PAUSE)


def can_draft(req: Request) -> bool:
    """Whether a sequence's sampling allows drafts: what reads the whole history per row (penalties)
    or log-probabilities (each kept row's would be needed) decodes one token a step. (A grammar allows
    prompt-lookup drafts, cut to what it allows: `Speculator.valid_drafts`.)"""
    p = req.params
    return (
        p.logprobs is None
        and p.prompt_logprobs is None
        and p.presence_penalty == 0
        and p.frequency_penalty == 0
        and p.repetition_penalty == 1.0
    )
