"""What the engine hands back for a request, step by step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass
class Logprob:
    """The sampled token's log-probability and the top alternatives (descending)."""

    token_id: int
    token: str
    logprob: float
    top: list[TokenLogprob] = field(default_factory=list)
    rank: int | None = None  # a prompt token's, among its position's tokens (1: the likeliest)


@dataclass
class CompletionOutput:
    """One of a request's `n` completions. `*_delta` is what this output added (empty while an
    incomplete UTF-8 character or a possible stop string is held back). `text`/`token_ids`/`logprobs`
    are cumulative and filled on the request's final output only (empty before): a stream reads the
    deltas, and copying everything into every output would cost O(length^2) per stream."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None  # one per token, when asked for
    logprobs_delta: list[Logprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic seconds) for latency metrics."""

    arrival_time: float
    scheduled_time: float | None = None  # first time it got a slot (queue time ends)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt: str | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # precedes it); on the request's first output and its final one (None on those between).
    prompt_logprobs: list[Logprob | None] | None = None
    error: str | None = None  # why the engine failed this request (finish_reason "error")
