"""The engine core's side of structured output: grammars compiled off the step loop, one matcher per
sequence, and each step a bitmask of the tokens each grammar allows (vLLM V1's StructuredOutputManager).

- A request with a grammar waits here, out of the scheduler, while a thread compiles its grammar
  (llguidance drops the GIL while it compiles); compiled grammars are cached by source, and each of
  the request's n sequences gets its own copy of the matcher. Then its leader joins the scheduler.
- Each step, for the scheduled sequences that sample a token: one int32 bitmask row each (bit t of
  the row: token t allowed), filled by llguidance (its thread pool for large batches on large
  machines), as one `GrammarBitmask` for the batch, which the core hands the executor with the step;
  the sampler applies it on the logits' device.
- After the step, each matcher consumes its sequence's token; a finished grammar ends the sequence.
- Speculative decoding: a prompt-lookup draft is cut to the prefix its grammar allows (`valid_drafts`),
  and a sequence with k drafts gets k + 1 rows, the allowed tokens after each draft prefix (its
  matcher consumes the drafts and rolls them back), so the verifier judges each position under the
  grammar, and a kept draft is consumed as any token is.

A step with no grammar request does no work here: every entry point returns at `is_active`.
The API process already validated every grammar (pagoda.service.grammar), so a compile error here is
unexpected; it fails only that request. No torch in this module.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from threading import Lock
from typing import TYPE_CHECKING

import numpy as np

from pagoda.service.engine.core.request import Request, RequestStatus
from pagoda.service.engine.core.scheduler import GrammarBitmask, SchedulerOutput
from pagoda.service.grammar import Grammar

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher, LLTokenizer

    from pagoda.service.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_MAX_CACHED_GRAMMARS = 256
_COMPILE_THREADS = 2
# Bitmask fills go to llguidance's thread pool only for many rows on a machine with cores to spare:
# its idle threads spin, and on 2 cores that stole the forward pass's CPU (16 constrained rows: decode
# steps 2x slower with the pool, the same as unconstrained steps filled one row after another, at
# 7-40 µs per row). 4 threads fill 64 rows in well under a millisecond.
_PARALLEL_MIN_ROWS = 32
_PARALLEL_MIN_CPUS = 8
_PARALLEL_THREADS = 4


class StructuredOutputManager:
    def __init__(self, load_tokenizer: Callable[[], Tokenizer], eos_token_ids: set[int]) -> None:
        self._load_tokenizer = load_tokenizer  # called once, on a compile thread, at the first grammar
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: LLTokenizer | None = None
        self._ll_executor: LLExecutor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = Lock()
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()  # llguidance grammar -> fresh matcher
        self._compiling: dict[str, tuple[Future[LLMatcher], list[Request]]] = {}  # by client request id
        self._matchers: dict[str, LLMatcher] = {}  # by sequence id

    @property
    def is_active(self) -> bool:
        return bool(self._matchers or self._compiling)

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar (they count as waiting in the engine's stats)."""
        return len(self._compiling)

    def is_compiling(self, client_id: str) -> bool:
        return client_id in self._compiling

    # ---- requests in and out ------------------------------------------------------------------------

    def add(self, client_id: str, seqs: list[Request], grammar: Grammar) -> None:
        """Start compiling; the request's leader is handed back by `take_ready` once it is done."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="pagoda-grammar")
        self._compiling[client_id] = (self._pool.submit(self._compile, grammar), seqs)

    def take_ready(self) -> tuple[list[Request], dict[str, str]]:
        """Leaders whose grammar is compiled (to schedule now), and requests whose grammar failed
        (client id -> why)."""
        ready: list[Request] = []
        failed: dict[str, str] = {}
        for client_id, (future, seqs) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[client_id]
            try:
                template = future.result()
            except Exception as exc:
                logger.exception("grammar of request %s failed to compile", client_id)
                failed[client_id] = f"the grammar failed to compile: {exc}"
                continue
            if template.is_error():
                failed[client_id] = f"the grammar failed to compile: {template.get_error()}"
                continue
            for seq in seqs:
                self._matchers[seq.request_id] = template.deep_copy()
            ready.append(seqs[0])
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Block until some grammar is compiled (the step loop has nothing else to run)."""
        if self._compiling:
            wait([f for f, _ in self._compiling.values()], timeout_s, return_when=FIRST_COMPLETED)

    def remove(self, client_id: str, seqs: list[Request]) -> None:
        """Forget a request (finished or aborted), compiled or not."""
        self._compiling.pop(client_id, None)  # a grammar still compiling is cached all the same
        for seq in seqs:
            self._matchers.pop(seq.request_id, None)

    # ---- one step -----------------------------------------------------------------------------------

    def bitmask(self, out: SchedulerOutput) -> GrammarBitmask | None:
        """The allowed tokens of every scheduled sequence with a grammar that samples this step (None:
        there is none). Its matchers must have consumed the sequences' last tokens."""
        if not self.is_active:
            return None
        rows = [
            (i, matcher, seq.draft_token_ids)
            for i, seq in enumerate(out.requests)
            if (matcher := self._matchers.get(seq.request_id)) is not None
            and out.needs_sample(i)
            and seq.status is not RequestStatus.FINISHED  # ended by the step before: its token is dropped
        ]
        if not rows:
            return None
        from llguidance.numpy import (
            allocate_token_bitmask,
            fill_next_token_bitmask,
            fill_next_token_bitmask_par,
        )

        assert self._ll_tokenizer is not None  # set by the first compile
        if any(drafts for _, _, drafts in rows):
            return self._bitmask_with_drafts(rows)
        bitmask = allocate_token_bitmask(len(rows), self._ll_tokenizer.vocab_size)
        if self._ll_executor is not None and len(rows) >= _PARALLEL_MIN_ROWS:
            fill_next_token_bitmask_par(
                self._ll_executor, [(m, k) for k, (_, m, _) in enumerate(rows)], bitmask
            )
        else:
            for k, (_, matcher, _) in enumerate(rows):
                fill_next_token_bitmask(matcher, bitmask, k)
        self._allow_every_eos(bitmask)
        return GrammarBitmask([i for i, _, _ in rows], bitmask)

    def _bitmask_with_drafts(self, rows: list[tuple[int, LLMatcher, list[int]]]) -> GrammarBitmask:
        """One row per verified position: a matcher consumes its drafts one by one, filling the row
        after each, then rolls them back (the drafts were checked by `valid_drafts`)."""
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        assert self._ll_tokenizer is not None
        bitmask = allocate_token_bitmask(sum(1 + len(d) for _, _, d in rows), self._ll_tokenizer.vocab_size)
        batch_rows: list[int] = []
        positions: list[int] = []
        for i, matcher, drafts in rows:
            for j in range(len(drafts) + 1):
                fill_next_token_bitmask(matcher, bitmask, len(batch_rows))
                batch_rows.append(i)
                positions.append(j)
                if j < len(drafts) and not matcher.consume_token(drafts[j]):
                    raise AssertionError(f"draft token {drafts[j]} broke its grammar: {matcher.get_error()}")
            if drafts:
                matcher.rollback(len(drafts))
        self._allow_every_eos(bitmask)
        return GrammarBitmask(batch_rows, bitmask, positions)

    def valid_drafts(self, seq: Request, tokens: list[int]) -> int:
        """How many of `tokens` (drafts after `seq`'s last token) its grammar allows in a row, stopping
        before any end-of-sequence token (the verifier's own token may still end it). The matcher must
        have consumed the sequence's tokens."""
        matcher = self._matchers.get(seq.request_id)
        if matcher is None:
            return 0
        eos = set(self.eos_token_ids)
        tokens = tokens[: next((j for j, t in enumerate(tokens) if t in eos), len(tokens))]
        return matcher.validate_tokens(tokens) if tokens else 0

    def accept(self, seq: Request) -> bool:
        """Advance `seq`'s matcher by its new token; True when the grammar ends the sequence.

        A complete grammar allows only end-of-sequence tokens, so the model's next token is EOS and the
        sequence ends as any other does (EOS never shows in the text). True here means the sequence
        went on past that (`ignore_eos`), or the token broke the grammar, which the mask prevents."""
        matcher = self._matchers.get(seq.request_id) if self._matchers else None
        if matcher is None:
            return False
        token = seq.token_ids[-1]
        if token in self.eos_token_ids:
            return True
        if not matcher.consume_token(token):
            logger.warning("%s: token %d broke its grammar: %s", seq.request_id, token, matcher.get_error())
            return True
        return False

    # ---- internals ----------------------------------------------------------------------------------

    def _compile(self, grammar: Grammar) -> LLMatcher:
        """On a compile thread: the grammar's fresh matcher, from the cache when seen before."""
        from llguidance import LLExecutor, LLMatcher, LLTokenizer

        serialized = grammar.to_llguidance()
        with self._lock:
            if self._ll_tokenizer is None:
                tokenizer = self._load_tokenizer()
                eos = self.eos_token_ids[0] if self.eos_token_ids else None
                self._ll_tokenizer = LLTokenizer(tokenizer.backend.to_str(), eos_token=eos)
                if (os.cpu_count() or 1) >= _PARALLEL_MIN_CPUS:
                    self._ll_executor = LLExecutor(_PARALLEL_THREADS)
            cached = self._cache.get(serialized)
            if cached is not None:
                self._cache.move_to_end(serialized)
                return cached
            ll_tokenizer = self._ll_tokenizer
        matcher = LLMatcher(ll_tokenizer, serialized, log_level=0)  # drops the GIL while compiling
        if not matcher.is_error():
            with self._lock:
                self._cache[serialized] = matcher
                while len(self._cache) > _MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
        return matcher

    def _allow_every_eos(self, bitmask: np.ndarray) -> None:
        """llguidance knows one end-of-sequence token; where it is allowed, allow the model's others."""
        if len(self.eos_token_ids) < 2:
            return
        words = bitmask.view(np.uint32)
        first = self.eos_token_ids[0]
        allowed = (words[:, first // 32] >> np.uint32(first % 32)) & np.uint32(1) == 1
        for eos in self.eos_token_ids[1:]:
            if eos // 32 < words.shape[1]:
                words[allowed, eos // 32] |= np.uint32(1 << (eos % 32))
