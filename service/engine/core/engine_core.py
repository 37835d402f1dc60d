"""The engine core: scheduler, KV block manager and the step. Token ids in, token ids out.

One client request (n completions) maps to n `Request` sequences; the first is the leader that
computes the shared prompt, the others fork from it. The core ends a sequence on what it can see in
token ids (EOS, a stop token id, max_tokens, the context length); text, stop strings and output
building belong to the API process, which aborts a sequence whose text hit a stop string.

The model is behind `ModelExecutor`: this module imports no torch, so the core runs in CPU unit tests
with a fake executor, and runs the same in-process (offline `LLM`) or in its own process (`pagoda serve`).

Asynchronous scheduling: with `async_scheduling`, a step queues its batch on the device and then
completes the step queued before it (reads its tokens, checks stops, builds outputs), so the host's
work overlaps the device's. The scheduler counts a sampled token before its value is known (a
`PLACEHOLDER`, filled on the device for the next step's input and on the host at completion); a
sequence that stops is therefore computed one step too many, and that token is dropped. What needs
the real last token on the host before sampling (penalties) or waits for the device anyway (prompt
log-probabilities) makes the steps run in turn while such a request is in the engine. Grammars do not:
a step is queued in two calls, `forward` then `sample`, and between them the core takes step N's
tokens (its matchers consume them) and fills step N+1's bitmask while the device runs N+1's forward
pass, as vLLM V1's `execute_model` / `sample_tokens` do.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, Protocol

from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.core.block_manager import BlockManager
from pagoda.service.engine.core.kv_events import build_publisher
from pagoda.service.engine.core.lora_slots import LoRASlots
from pagoda.service.engine.core.request import PLACEHOLDER, Request, RequestStatus
from pagoda.service.engine.core.scheduler import GrammarBitmask, Scheduler, SchedulerOutput
from pagoda.service.engine.core.speculation import Speculator
from pagoda.service.engine.core.structured_output import StructuredOutputManager
from pagoda.service.engine.messages import (
    NO_TOKEN,
    STEP_SECONDS_BUCKETS,
    AddRequest,
    EngineStats,
    PromptLogprobs,
    RequestFailure,
    SampleResult,
    TokenOutput,
)
from pagoda.service.gc_pauses import GcPauses
from pagoda.service.model import load_tokenizer as load_tokenizer_from
from pagoda.service.sampling_params import SamplingParams
from pagoda.service.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class KVLayout(Protocol):
    num_blocks: int
    bytes_per_block: int


class StepResult(Protocol):
    sampled: dict[str, SampleResult]  # sequence id -> its next token
    accepted: dict[str, int]  # sequence id -> how many of its drafts stay (those that drafted)
    prompt_logprobs: dict[str, tuple[int, list[SampleResult]]]  # sequence id -> (first position, scores)


class PendingResult(Protocol):
    def result(self) -> StepResult:
        """Wait for the step's sampled tokens."""


class ModelExecutor(Protocol):
    """What the core needs of the model side (one rank in-process, or all TP ranks)."""

    @property
    def kv(self) -> KVLayout: ...

    @property
    def max_model_len(self) -> int: ...

    def forward(self, out: SchedulerOutput, after: PendingResult | None) -> object:
        """Queue `out`'s forward pass without waiting for it; `after` is the step queued before, whose
        tokens are `out`'s inputs where the host holds a `PLACEHOLDER` (async scheduling only)."""

    def sample(self, forwarded: Any, grammar: GrammarBitmask | None) -> PendingResult:
        """Queue the sampling of what `forward` returned; `grammar`: the allowed tokens of the batch's
        rows under a grammar."""

    @property
    def can_overlap(self) -> bool:
        """Whether `forward` and `sample` return before the step has run (so async scheduling pays)."""

    def propose_drafts(self, reqs: list[Request], k: list[int]) -> list[list[int]]:
        """A draft model's `k[i]` greedy tokens after each request's last token (speculative decoding
        with `{"model": ...}`); an executor without one raises."""

    def add_lora(self, name: str, path: str) -> None:
        """Read and check a LoRA adapter (PEFT folder) against the model; raise ValueError saying why
        it cannot be served. Its slot is loaded later, by the step that first needs it."""

    def check_alive(self) -> None:
        """Raise when a rank has died (the core then fails rather than hang in a collective)."""

    def shutdown(self) -> None:
        """Stop every rank; idempotent."""


@dataclass
class _IsolatedResult:
    sampled: dict[str, SampleResult]
    prompt_logprobs: dict[str, tuple[int, list[SampleResult]]]
    accepted: dict[str, int]

    def result(self) -> StepResult:
        return self


@dataclass
class _Done:
    done: StepResult

    def result(self) -> StepResult:
        return self.done


@dataclass
class _InFlight:
    """A step handed to the executor whose tokens the core has not taken yet."""

    out: SchedulerOutput
    sampling: list[Request]  # the sequences holding a PLACEHOLDER for this step's token, in batch order
    pending: PendingResult
    # A pure decode step (every row a sequence's next token or its drafts) is timed for the speculator's
    # rates when it completes; `drafted`: some sequence drafted in it.
    timed: bool = False
    drafted: bool = False


def _needs_turns(params: SamplingParams) -> bool:
    """Whether a request's sampling reads its last token on the host, or waits for the device anyway."""
    return (
        params.presence_penalty != 0
        or params.frequency_penalty != 0
        or params.repetition_penalty != 1.0
        or params.prompt_logprobs is not None
    )


class StepOutputs(NamedTuple):
    tokens: list[TokenOutput]  # a new token for every sequence that got one, in batch order
    prompt_logprobs: list[PromptLogprobs]
    failures: list[RequestFailure]  # client requests that failed inside this step (and ended)


# Steps in a row in which every request, run alone, still failed: then the model side is broken, not a
# request, and the core gives up (the API process fails health, and Kubernetes restarts the pod).
MAX_FAILED_STEPS_IN_A_ROW = 3
# Logged when a step raised and its sequences are re-run one by one (`_execute_isolated`); the tests
# fail on it unless they raise on purpose (tests/conftest.py), since a re-run hides a broken batch path.
ISOLATED_STEP_WARNING = "a step of %d sequences failed (%r); running them one by one"
# A step at least this long, and longer than any before it, is logged: the longest legitimate steps
# (a first Triton compile or autotune, a long prefill) are what `--engine-stall-timeout` must exceed.
LOG_STEP_OVER_S = 1.0
# With nothing to run but grammars compiling, how long a step waits for one (new messages wait as long).
_GRAMMAR_WAIT_S = 0.02


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        executor: ModelExecutor,
        eos_token_ids: set[int],
        load_tokenizer: Callable[[], Tokenizer] | None = None,
    ) -> None:
        """`load_tokenizer`: for structured output, called at the first grammar (default: the model's)."""
        self.executor = executor
        self.max_model_len = executor.max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        # vLLM's --kv-events-config: what enters and leaves the prefix cache, for cache-aware routers.
        self.kv_events = build_publisher(config.kv_events)
        self.block_manager = BlockManager(
            executor.kv.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            record_events=self.kv_events is not None,
        )
        self.lora_slots = LoRASlots(config.lora.max_loras) if config.lora is not None else None
        self._lora_failures: list[RequestFailure] = []  # requests of adapters unloaded under them
        self._lora_counts: dict[str, Counter[str]] = {k: Counter() for k in ("requests", "tokens", "loads")}
        self._lora_load_seconds: dict[str, float] = {}
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_mixed_prefill_tokens,
            self.lora_slots,
        )
        for module in config.lora.modules if config.lora is not None else ():
            if error := self.lora_op(module.name, module.path):
                raise ValueError(f"--lora-modules {module.name}: {error}")
        self._requests: dict[str, list[Request]] = {}  # client request id -> its n sequences
        self._scheduled_time: dict[str, float] = {}  # sequence id -> first scheduled, until its first token
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.computed_tokens_total = 0  # tokens run through the model (prefix-cache hits are not)
        self.failed_requests_total = 0
        self._failed_steps_in_a_row = 0
        kinds = ("decode", "mixed")
        self._step_bucket_counts = {k: [0] * (len(STEP_SECONDS_BUCKETS) + 1) for k in kinds}
        self._step_seconds_sum = dict.fromkeys(kinds, 0.0)
        self.longest_step_s = 0.0
        self.gc_pauses: GcPauses | None = None  # set by the core process, whose pauses they are
        self.structured_output = StructuredOutputManager(
            load_tokenizer or partial(load_tokenizer_from, config.model_path), eos_token_ids
        )
        is_async = config.async_scheduling
        self.is_async = executor.can_overlap if is_async is None else is_async
        self._in_flight: _InFlight | None = None
        # When the last step completed: a step's time for the speculator's rates is the period from the
        # completion before it to its own. With async scheduling a step that runs in turn first waits for
        # the one in flight, and the step after it starts with nothing on the device: timed from their own
        # starts, the first would carry the other's device time and the second only its launch.
        self._last_completed = time.monotonic()
        self._taking_turns: set[str] = set()  # requests that make steps run in turn (`_needs_turns`)
        spec = config.speculative
        self.speculator = (
            Speculator(
                spec,
                self.max_model_len,
                executor.propose_drafts if spec.method == "draft_model" else None,
                self.structured_output.valid_drafts,
            )
            if spec is not None
            else None
        )

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests) or self._in_flight is not None

    def add_request(self, req: AddRequest) -> None:
        """Queue a request validated by the API process (ids in range, room in the context)."""
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.lora_name is not None and (
            self.lora_slots is None or req.lora_name not in self.lora_slots.adapters
        ):
            # Unloaded after the API process checked the name: this request fails, nothing else.
            self._lora_failures.append(
                RequestFailure(req.request_id, f"no LoRA adapter {req.lora_name!r} is loaded")
            )
            return
        n = req.params.n
        seqs = [
            Request(
                f"{req.request_id}#{i}", req.prompt_token_ids, req.params, req.arrival_time, i, req.lora_name
            )
            for i in range(n)
        ]
        seqs[0].pending_forks = seqs[1:]
        self._requests[req.request_id] = seqs
        if req.lora_name is not None:
            self._lora_counts["requests"][req.lora_name] += 1
        if _needs_turns(req.params):
            self._taking_turns.add(req.request_id)
        if req.params.grammar is not None:  # scheduled once its grammar is compiled, off this thread
            self.structured_output.add(req.request_id, seqs, req.params.grammar)
        else:
            self.scheduler.add(seqs[0])
        self.prompt_tokens_total += len(req.prompt_token_ids)

    def lora_op(self, name: str, path: str | None) -> str | None:
        """Load (`path` given) or unload adapter `name`; None when done, else why not. Unloading ends
        the requests running under it (each a `RequestFailure`, from `take_lora_failures`)."""
        if self.lora_slots is None:
            return "LoRA adapters are not enabled on this server (--enable-lora)"
        if path is None:
            if name not in self.lora_slots.adapters:
                return f"no LoRA adapter {name!r} is loaded"
            for request_id, seqs in list(self._requests.items()):
                if seqs[0].lora_name == name:
                    self._lora_failures.append(
                        RequestFailure(request_id, f"the LoRA adapter {name!r} was unloaded")
                    )
                    self.abort(request_id)
            self.lora_slots.unregister(name)
            return None
        if name in self.lora_slots.adapters:
            return f"a LoRA adapter named {name!r} is already loaded"
        started = time.monotonic()
        try:
            self.executor.add_lora(name, path)
        except ValueError as exc:
            return str(exc)
        self._lora_counts["loads"][name] += 1
        self._lora_load_seconds[name] = self._lora_load_seconds.get(name, 0.0) + time.monotonic() - started
        self.lora_slots.register(name, path)
        return None

    def take_lora_failures(self) -> list[RequestFailure]:
        failures, self._lora_failures = self._lora_failures, []
        return failures

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Free a request's sequences (or the one at `index`); unknown or finished ones are ignored."""
        seqs = self._requests.get(request_id)
        if seqs is None:
            return
        for seq in seqs if index is None else seqs[index : index + 1]:
            self._finish(seq)
        self._forget_if_done(request_id)
        if not self._requests and self._in_flight is not None:  # nothing else waits on it
            in_flight, self._in_flight = self._in_flight, None
            self._complete(in_flight, StepOutputs([], [], []))

    def step(self) -> StepOutputs:
        """Run one batch; with async scheduling, queue it and complete the one queued before. A request
        that makes the step raise fails alone (see `_execute_isolated`). The step's KV-cache events go
        out after it."""
        outputs = self._step()
        if self.kv_events is not None:
            self.kv_events.publish(self.block_manager.take_events())
        return outputs

    def close(self) -> None:
        """Release what the core holds besides the executor (the KV-events sockets)."""
        if self.kv_events is not None:
            self.kv_events.close()

    def _step(self) -> StepOutputs:
        started = time.monotonic()
        outputs = StepOutputs([], [], [])
        if self.structured_output.is_active:
            outputs.failures.extend(self._admit_compiled())
        speculates = self.speculator is not None and self.speculator.plan(self.scheduler.running)
        overlap = self.is_async and not self._taking_turns and not speculates
        before, self._in_flight = self._in_flight, None
        if before is not None and not overlap:
            self._complete(before, outputs)  # this step's sampling (or drafts) needs its tokens on the host
            before = None
        if speculates:
            assert self.speculator is not None
            self.speculator.draft(self.scheduler.running)
        out = self.scheduler.schedule()
        if speculates:  # drafts of sequences the step has no room for are dropped, not computed later
            scheduled = {id(r) for r in out.requests}
            for req in self.scheduler.running:
                if req.num_drafts and id(req) not in scheduled:
                    req.drop_drafts()
            assert self.speculator is not None
            self.speculator.fill(out.requests)
        # A pure decode step (every row a sequence's next token, or its drafts) is timed for the
        # speculator's rates once it completes. But not an overlapped step launched with nothing in
        # flight (the first after a step in turn): its period holds its own preparation, which the
        # steady overlapped steps it stands for hide behind the step before; timed, it would make
        # plain steps look slower than they run and keep a losing draft on.
        drafted = speculates and any(r.num_drafts for r in out.requests)
        timed = (
            self.speculator is not None
            and (drafted or not overlap or before is not None)
            and all(
                n == 1 + r.num_drafts for r, n in zip(out.requests, out.num_scheduled_tokens, strict=True)
            )
        )
        if out.is_empty:
            if before is not None:
                self._complete(before, outputs)
            else:
                self.structured_output.wait(_GRAMMAR_WAIT_S)  # only grammars left to compile: wait for one
                self._last_completed = time.monotonic()  # no step's time: the next step's period starts here
            return outputs
        behind = [before] if before is not None else []  # completed once, by the first to need its tokens
        now = time.monotonic()
        for seq in out.requests:
            self._scheduled_time.setdefault(seq.request_id, now)
        self.computed_tokens_total += out.total_num_tokens
        pending: PendingResult
        try:
            forwarded = self.executor.forward(out, before.pending if before else None)
            if behind and self.structured_output.is_active:  # while the device runs `out`'s forward pass
                self._complete(behind.pop(), outputs)  # the grammars consume the tokens of the step before
            pending = self.executor.sample(forwarded, self.structured_output.bitmask(out))
            if not overlap:
                pending = _Done(pending.result())
            self._failed_steps_in_a_row = 0
        except Exception as exc:
            self.executor.check_alive()  # a dead rank is the engine's failure, not a request's
            if behind:  # its tokens are `out`'s inputs: on the host from here
                self._complete(behind.pop(), outputs)
            pending, isolated_failures = self._execute_isolated(out, exc)
            outputs.failures.extend(isolated_failures)
            overlap = False
        if behind:
            self._complete(behind.pop(), outputs)  # while the device runs `out`
        step = _InFlight(out, self.scheduler.advance(out), pending, timed, drafted)
        if overlap and self._requests:
            self._in_flight = step
        else:  # in turn; or every request ended meanwhile, so nothing waits on it: drain it now
            self._complete(step, outputs)
        self._time_step(out, time.monotonic() - started)
        return outputs

    def _time_step(self, out: SchedulerOutput, seconds: float) -> None:
        """Count one step's wall time: with async scheduling, the period between steps in a steady state."""
        kind = "decode" if out.total_num_tokens == len(out.requests) else "mixed"
        self._step_bucket_counts[kind][bisect.bisect_left(STEP_SECONDS_BUCKETS, seconds)] += 1
        self._step_seconds_sum[kind] += seconds
        if seconds > self.longest_step_s:
            self.longest_step_s = seconds
            if seconds >= LOG_STEP_OVER_S:
                logger.info(
                    "the longest step so far: %.3f s (%d sequences, %d tokens)",
                    seconds, len(out.requests), out.total_num_tokens,
                )  # fmt: skip

    def _complete(self, step: _InFlight, outputs: StepOutputs) -> None:
        """Take a step's tokens: fill its placeholders, check stops, and add its outputs to `outputs`."""
        result = step.pending.result()
        owners = {seq.request_id: seq for seq in step.out.requests}
        outputs.prompt_logprobs.extend(
            PromptLogprobs(owners[seq_id].request_id.rpartition("#")[0], position, scores)
            for seq_id, (position, scores) in result.prompt_logprobs.items()
        )
        done: set[str] = set()
        for seq in step.sampling:
            if seq.status is RequestStatus.FINISHED:
                continue  # stopped or aborted since: its token is dropped
            sample = result.sampled[seq.request_id]
            if sample.token_id == NO_TOKEN:
                outputs.failures.append(self._fail_unsamplable(seq))
                continue
            if seq.num_drafts:
                samples = self._keep_accepted(seq, result.accepted[seq.request_id], sample)
            else:
                assert seq.token_ids[-1] == PLACEHOLDER
                seq.token_ids.pop()
                samples = [sample]
            client_id = seq.request_id.rpartition("#")[0]
            for sample in samples:  # one token, or the accepted drafts and the verifier's token
                seq.token_ids.append(sample.token_id)
                self.generation_tokens_total += 1
                if seq.lora_name is not None:
                    self._lora_counts["tokens"][seq.lora_name] += 1
                output = TokenOutput(client_id, seq.index, sample)
                if seq.num_output_tokens == 1:
                    output.num_cached_tokens = seq.num_cached_tokens
                    output.scheduled_time = self._scheduled_time.pop(seq.request_id, None)
                self._check_stop(seq, output)
                if output.finish_reason is None and self.structured_output.accept(seq):
                    output.finish_reason = "stop"  # past its grammar's end, or off it
                outputs.tokens.append(output)
                if output.finish_reason is not None:
                    self._finish(seq)
                    done.add(client_id)
                    break
            if len(samples) > 1 and seq.status is not RequestStatus.FINISHED:
                seq.num_computed_tokens = seq.num_tokens - 1  # the accepted drafts' KV is the real one
                self.block_manager.cache_computed_blocks(seq)
            if self.speculator is not None and seq.status is not RequestStatus.FINISHED:
                self.speculator.after_token(seq, len(self.scheduler.running))
        for client_id in done:
            self._forget_if_done(client_id)
        now = time.monotonic()
        if step.timed and step.out.requests and self.speculator is not None:
            tokens = len(step.out.requests) + sum(result.accepted.values())
            self.speculator.rates.record(
                len(step.out.requests), step.drafted, tokens, now - self._last_completed
            )
        self._last_completed = now

    def _fail_unsamplable(self, seq: Request) -> RequestFailure:
        """End `seq`'s whole client request: its constraints left no token to sample (a 400, as its own
        parameters are at fault; nothing was appended)."""
        client_id = seq.request_id.rpartition("#")[0]
        self._end_failed(client_id)
        return RequestFailure(
            client_id,
            "no next token is possible: allowed_token_ids, min_tokens (which forbids end-of-sequence "
            "and stop tokens) and the structured output's grammar leave none in common",
            invalid=True,
        )

    def _end_failed(self, client_id: str) -> None:
        """End every sequence of a client request that failed (already finished ones stay so) and
        forget it; count the failure."""
        for seq in self._requests.get(client_id, []):
            self._finish(seq)
        self._forget_if_done(client_id)
        self.failed_requests_total += 1

    def _keep_accepted(self, seq: Request, accepted: int, sample: SampleResult) -> list[SampleResult]:
        """A sequence that drafted: its drafts leave `token_ids` (so each kept token is appended and
        checked for a stop in turn, as if decoded one at a time); returns the accepted drafts and the
        verifier's token, in order. The KV written for rejected drafts is overwritten by later steps."""
        assert self.speculator is not None
        drafts = seq.draft_token_ids
        self.speculator.judged(seq, len(drafts), accepted)
        seq.drop_drafts()
        return [*(SampleResult(t) for t in drafts[:accepted]), sample]

    def _execute_isolated(
        self, out: SchedulerOutput, error: Exception
    ) -> tuple[_IsolatedResult, list[RequestFailure]]:
        """The batch raised `error`: run its sequences one at a time, so only those that fail alone
        fail (with their whole client request); the others get their tokens as if nothing happened.

        Re-running is safe: nothing in the core moved yet, and a rerun writes the same KV slots with the
        same values. Past `MAX_FAILED_STEPS_IN_A_ROW` steps in which every sequence failed alone, the
        error is the model side's, not a request's: raise it and let the engine fail."""
        logger.warning(ISOLATED_STEP_WARNING, len(out.requests), error)
        sampled: dict[str, SampleResult] = {}
        prompt_logprobs: dict[str, tuple[int, list[SampleResult]]] = {}
        accepted: dict[str, int] = {}
        failed: dict[str, str] = {}  # client request id -> why
        for seq, num_tokens in zip(out.requests, out.num_scheduled_tokens, strict=True):
            client_id = seq.request_id.rpartition("#")[0]
            if client_id in failed or seq.status is not RequestStatus.RUNNING:
                continue
            try:
                single = SchedulerOutput([seq], [num_tokens], out.copy_ops)
                forwarded = self.executor.forward(single, None)
                alone = self.executor.sample(forwarded, self.structured_output.bitmask(single)).result()
            except Exception as exc:
                self.executor.check_alive()
                logger.exception("request %s failed inside the step", client_id)
                failed[client_id] = f"{type(exc).__name__}: {exc}"
                continue
            sampled.update(alone.sampled)
            prompt_logprobs.update(alone.prompt_logprobs)
            accepted.update(alone.accepted)
        if len(failed) == len({s.request_id.rpartition("#")[0] for s in out.requests}):
            self._failed_steps_in_a_row += 1
            if self._failed_steps_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
                raise error
        else:
            self._failed_steps_in_a_row = 0
        for client_id in failed:
            self._end_failed(client_id)
        failures = [RequestFailure(client_id, message) for client_id, message in failed.items()]
        return _IsolatedResult(sampled, prompt_logprobs, accepted), failures

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

    def _admit_compiled(self) -> list[RequestFailure]:
        """Schedule the requests whose grammar is now compiled; fail those whose grammar did not."""
        ready, failed = self.structured_output.take_ready()
        for leader in ready:
            if leader.status is RequestStatus.WAITING:  # not aborted while compiling
                self.scheduler.add(leader)
        for client_id in failed:
            for seq in self._requests.get(client_id, []):
                seq.status = RequestStatus.FINISHED  # never reached the scheduler
            self._forget_if_done(client_id)
        self.failed_requests_total += len(failed)
        return [RequestFailure(client_id, message) for client_id, message in failed.items()]

    def _finish(self, seq: Request) -> None:
        if self.structured_output.is_compiling(seq.request_id.rpartition("#")[0]):
            seq.status = RequestStatus.FINISHED  # not in the scheduler yet
        else:
            self.scheduler.finish(seq)
        self._scheduled_time.pop(seq.request_id, None)

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self._requests.get(request_id)
        if seqs is not None and all(s.status is RequestStatus.FINISHED for s in seqs):
            del self._requests[request_id]
            self._taking_turns.discard(request_id)
            self.structured_output.remove(request_id, seqs)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_waiting=len(self.scheduler.waiting) + self.structured_output.num_compiling,
            num_running=len(self.scheduler.running),
            kv_cache_usage=bm.usage,
            num_kv_blocks=bm.num_blocks,
            block_size=bm.block_size,
            num_preemptions_total=self.scheduler.num_preemptions,
            prefix_cache_queries_total=bm.prefix_queries_tokens,
            prefix_cache_hits_total=bm.prefix_hits_tokens,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            step_bucket_counts={k: list(v) for k, v in self._step_bucket_counts.items()},
            step_seconds_sum=dict(self._step_seconds_sum),
            gc_pause_seconds_total=self.gc_pauses.seconds_total if self.gc_pauses else 0.0,
            gc_collections_total=self.gc_pauses.collections_total if self.gc_pauses else 0,
            **self._spec_stats(),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict[str, Any]:
        slots = self.lora_slots
        if slots is None:
            return {}
        sched = self.scheduler
        return {
            "lora_adapters": dict(slots.adapters),
            "max_loras": slots.max_loras,
            "lora_running": sorted({r.lora_name for r in sched.running if r.lora_name is not None}),
            "lora_waiting": sorted({r.lora_name for r in sched.waiting if r.lora_name is not None}),
            "lora_requests_total": dict(self._lora_counts["requests"]),
            "lora_generation_tokens_total": dict(self._lora_counts["tokens"]),
            "lora_loads_total": dict(self._lora_counts["loads"]),
            "lora_load_seconds_total": dict(self._lora_load_seconds),
            "lora_slot_loads_total": dict(slots.slot_loads_total),
        }

    def _spec_stats(self) -> dict[str, Any]:
        if self.speculator is None:
            return {}
        spec = self.speculator.stats
        return {
            "spec_num_drafts_total": spec.num_drafts,
            "spec_num_draft_tokens_total": spec.num_draft_tokens,
            "spec_num_accepted_tokens_total": spec.num_accepted_tokens,
            "spec_accepted_per_position_total": list(spec.accepted_per_position),
        }
