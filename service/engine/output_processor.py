"""From sampled tokens to what a client sees: incremental text, stop conditions, log-probabilities.

Stop strings are checked on the detokenized text; text that might be the start of a stop string is
held back until it cannot be, so a stream never shows (part of) a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.service.engine.request import Request
from pagoda.service.engine.sampler import SampleResult
from pagoda.service.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprob
from pagoda.service.sampling_params import SamplingParams
from pagoda.service.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class CompletionState:
    """One of a client request's n completions, as far as it has been shown to the client."""

    seq: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""  # stop-checked text so far
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    logprobs: list[Logprob] | None = None
    num_emitted_logprobs: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class ClientRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[CompletionState]
    metrics: RequestMetrics
    prompt_logprobs: list[Logprob | None] | None = None

    @property
    def is_finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that begins some stop string."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def new_request(
        self,
        request_id: str,
        prompt: str | None,
        seqs: list[Request],
        params: SamplingParams,
        arrival_time: float,
    ) -> ClientRequest:
        token_ids = seqs[0].token_ids
        completions = [
            CompletionState(s, IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens))
            for s in seqs
        ]
        if params.logprobs is not None:
            for c in completions:
                c.logprobs = []
        client = ClientRequest(
            request_id,
            prompt,
            list(token_ids),
            params,
            completions,
            RequestMetrics(arrival_time=arrival_time),
        )
        if params.prompt_logprobs is not None:
            client.prompt_logprobs = [None]  # nothing scores the first prompt token
        return client

    def _logprob(self, sample: SampleResult) -> Logprob:
        top = [TokenLogprob(t, self.tokenizer.id_to_token(t), lp) for t, lp in sample.top or []]
        return Logprob(
            sample.token_id, self.tokenizer.id_to_token(sample.token_id), sample.logprob or 0.0, top
        )

    def add_prompt_logprobs(self, client: ClientRequest, position: int, scores: list[SampleResult]) -> None:
        """Scores of prompt tokens from `position` on; a recompute after preemption repeats none."""
        assert client.prompt_logprobs is not None
        known = len(client.prompt_logprobs)
        client.prompt_logprobs += [self._logprob(s) for s in scores[max(known - position, 0) :]]

    def process_token(
        self, client: ClientRequest, c: CompletionState, sample: SampleResult, now: float
    ) -> bool:
        """Take the token `c.seq` just got; True when that finishes the completion."""
        seq, params = c.seq, client.params
        token = seq.token_ids[-1]
        m = client.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            m.num_cached_tokens = seq.num_cached_tokens
        m.last_token_time = now
        if c.logprobs is not None and sample.logprob is not None:
            c.logprobs.append(self._logprob(sample))

        is_eos = token in self.tokenizer.eos_token_ids and not params.ignore_eos
        if is_eos or token in params.stop_token_ids:
            c.finish_reason, c.stop_reason = "stop", (None if is_eos else token)
        else:
            c.text += c.detokenizer.push([token])
            if params.stop:
                start = max(0, c.num_emitted_chars - max(len(s) for s in params.stop))
                found = [(i, s) for s in params.stop if (i := c.text.find(s, start)) != -1]
                if found:
                    index, stop = min(found)
                    c.text = c.text[:index]
                    c.finish_reason, c.stop_reason = "stop", stop
        if c.finish_reason is None and (
            (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens)
            or seq.num_tokens >= self.max_model_len
        ):
            c.finish_reason = "length"
        if c.finish_reason is not None and not isinstance(c.stop_reason, str):
            c.text += c.detokenizer.flush()  # a held-back partial character, if the stream ends in one
        return c.finish_reason is not None

    def make_output(self, client: ClientRequest, now: float) -> RequestOutput:
        """What changed since the last output (deltas) and everything so far (cumulative)."""
        outputs = []
        for c in client.completions:
            done = c.finish_reason is not None
            visible = len(c.text) if done else len(c.text) - held_back(c.text, client.params.stop)
            visible = max(visible, c.num_emitted_chars)
            token_ids = c.seq.output_token_ids
            outputs.append(
                CompletionOutput(
                    index=c.seq.index,
                    text=c.text[:visible],
                    token_ids=list(token_ids),
                    text_delta=c.text[c.num_emitted_chars : visible],
                    token_ids_delta=token_ids[c.num_emitted_tokens :],
                    logprobs=list(c.logprobs) if c.logprobs is not None else None,
                    logprobs_delta=c.logprobs[c.num_emitted_logprobs :] if c.logprobs is not None else None,
                    finish_reason=c.finish_reason,  # type: ignore[arg-type]
                    stop_reason=c.stop_reason,
                )
            )
            c.num_emitted_chars = visible
            c.num_emitted_tokens = len(token_ids)
            c.num_emitted_logprobs = len(c.logprobs) if c.logprobs is not None else 0
        if client.is_finished:
            client.metrics.finished_time = now
        return RequestOutput(
            client.request_id,
            client.prompt_token_ids,
            outputs,
            client.is_finished,
            client.metrics,
            client.prompt,
            list(client.prompt_logprobs) if client.prompt_logprobs is not None else None,
        )
