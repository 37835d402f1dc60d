"""The engine core: scheduler, KV block manager and the step. Token ids in, token ids out.

One client request (n completions) maps to n `Request` sequences; the first is the leader that
computes the shared prompt, the others fork from it. The core ends a sequence on what it can see in
token ids (EOS, a stop token id, max_tokens, the context length); text, stop strings and output
building belong to the API process, which aborts a sequence whose text hit a stop string.

The model is behind `ModelExecutor`: this module imports no torch, so the core runs in CPU unit tests
with a fake executor, and runs the same in-process (offline `LLM`) or in its own process (`pagoda serve`).
"""

from __future__ import annotations

import time
from typing import Protocol

from pagoda.service.engine.block_manager import BlockManager
from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.messages import AddRequest, EngineStats, PromptLogprobs, SampleResult, TokenOutput
from pagoda.service.engine.request import Request, RequestStatus
from pagoda.service.engine.scheduler import Scheduler, SchedulerOutput


class KVLayout(Protocol):
    num_blocks: int
    bytes_per_block: int


class StepResult(Protocol):
    sampled: dict[str, SampleResult]  # sequence id -> its next token
    prompt_logprobs: dict[str, tuple[int, list[SampleResult]]]  # sequence id -> (first position, scores)


class ModelExecutor(Protocol):
    """What the core needs of the model side (one rank in-process, or all TP ranks)."""

    @property
    def kv(self) -> KVLayout: ...

    @property
    def max_model_len(self) -> int: ...

    def execute(self, out: SchedulerOutput) -> StepResult: ...

    def check_alive(self) -> None:
        """Raise when a rank has died (the core then fails rather than hang in a collective)."""

    def shutdown(self) -> None:
        """Stop every rank; idempotent."""


class EngineCore:
    def __init__(self, config: EngineConfig, executor: ModelExecutor, eos_token_ids: set[int]) -> None:
        self.executor = executor
        self.max_model_len = executor.max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(
            executor.kv.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self._requests: dict[str, list[Request]] = {}  # client request id -> its n sequences
        self._scheduled_time: dict[str, float] = {}  # sequence id -> first scheduled, until its first token
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.computed_tokens_total = 0  # tokens run through the model (prefix-cache hits are not)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def add_request(self, req: AddRequest) -> None:
        """Queue a request validated by the API process (ids in range, room in the context)."""
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        n = req.params.n
        seqs = [
            Request(f"{req.request_id}#{i}", req.prompt_token_ids, req.params, req.arrival_time, index=i)
            for i in range(n)
        ]
        seqs[0].pending_forks = seqs[1:]
        self._requests[req.request_id] = seqs
        self.scheduler.add(seqs[0])
        self.prompt_tokens_total += len(req.prompt_token_ids)

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Free a request's sequences (or the one at `index`); unknown or finished ones are ignored."""
        seqs = self._requests.get(request_id)
        if seqs is None:
            return
        for seq in seqs if index is None else seqs[index : index + 1]:
            self._finish(seq)
        self._forget_if_done(request_id)

    def step(self) -> tuple[list[TokenOutput], list[PromptLogprobs]]:
        """Run one batch: a `TokenOutput` for every sequence that got a token, in batch order."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return [], []
        now = time.monotonic()
        for seq in out.requests:
            self._scheduled_time.setdefault(seq.request_id, now)
        self.computed_tokens_total += out.total_num_tokens
        result = self.executor.execute(out)
        owners = {seq.request_id: seq for seq in out.requests}
        prompt_logprobs = [
            PromptLogprobs(owners[seq_id].request_id.rpartition("#")[0], position, scores)
            for seq_id, (position, scores) in result.prompt_logprobs.items()
        ]
        grew = self.scheduler.update(out, {k: v.token_id for k, v in result.sampled.items()})
        outputs = []
        done: set[str] = set()
        for seq in grew:
            self.generation_tokens_total += 1
            client_id = seq.request_id.rpartition("#")[0]
            output = TokenOutput(client_id, seq.index, result.sampled[seq.request_id])
            if seq.num_output_tokens == 1:
                output.num_cached_tokens = seq.num_cached_tokens
                output.scheduled_time = self._scheduled_time.pop(seq.request_id, None)
            self._check_stop(seq, output)
            if output.finish_reason is not None:
                self._finish(seq)
                done.add(client_id)
            outputs.append(output)
        for client_id in done:
            self._forget_if_done(client_id)
        return outputs, prompt_logprobs

    def _check_stop(self, seq: Request, output: TokenOutput) -> None:
        params, token = seq.params, seq.token_ids[-1]
        if token in self.eos_token_ids and not params.ignore_eos:
            output.finish_reason = "stop"
        elif token in params.stop_token_ids:
            output.finish_reason, output.stop_reason = "stop", token
        elif (
            params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens
        ) or seq.num_tokens >= self.max_model_len:
            output.finish_reason = "length"

    def _finish(self, seq: Request) -> None:
        self.scheduler.finish(seq)
        self._scheduled_time.pop(seq.request_id, None)

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self._requests.get(request_id)
        if seqs is not None and all(s.status is RequestStatus.FINISHED for s in seqs):
            del self._requests[request_id]

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            kv_cache_usage=bm.usage,
            num_kv_blocks=bm.num_blocks,
            block_size=bm.block_size,
            num_preemptions_total=self.scheduler.num_preemptions,
            prefix_cache_queries_total=bm.prefix_queries_tokens,
            prefix_cache_hits_total=bm.prefix_hits_tokens,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
        )
