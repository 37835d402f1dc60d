"""From sampled tokens to what a client sees: incremental text, stop conditions, log-probabilities.

Stop strings are checked on the detokenized text; text that might be the start of a stop string is
held back until it cannot be, so a stream never shows (part of) a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.service.engine.messages import PromptLogprobs, SampleResult, TokenOutput
from pagoda.service.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprob
from pagoda.service.sampling_params import SamplingParams
from pagoda.service.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class CompletionState:
    """One of a client request's n completions, as far as it has been shown to the client."""

    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)  # generated so far
    text: str = ""  # stop-checked text so far
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    logprobs: list[Logprob] | None = None
    num_emitted_logprobs: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    undecoded: list[int] = field(default_factory=list)  # final-only: detokenized once, at the end


@dataclass
class ClientRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[CompletionState]
    metrics: RequestMetrics
    prompt_logprobs: list[Logprob | None] | None = None
    # Only the last output is wanted (`LLM.generate`): none is built before it, and without stop
    # strings the text is decoded once at the end. Host time per step is time the GPU waits for.
    final_only: bool = False
    has_output: bool = False  # the first output has gone out: those up to the final one skip prompt_logprobs

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
    """The API side of every request in flight: turns the core's token outputs into `RequestOutput`s."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.requests: dict[str, ClientRequest] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        final_only: bool = False,
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        completions = [
            CompletionState(
                i, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            )
            for i in range(params.n)
        ]
        if params.logprobs is not None:
            for c in completions:
                c.logprobs = []
        client = ClientRequest(
            request_id,
            prompt,
            list(prompt_token_ids),
            params,
            completions,
            RequestMetrics(arrival_time),
            final_only=final_only,
        )
        if params.prompt_logprobs is not None:
            client.prompt_logprobs = [None]  # nothing scores the first prompt token
        self.requests[request_id] = client

    def process(
        self, outputs: list[TokenOutput], prompt_logprobs: list[PromptLogprobs], now: float
    ) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """One core step's outputs -> an output for every request that changed (in batch order; for a
        final-only request, once it finishes), and the (request id, index) sequences the core must stop
        because their text hit a stop string."""
        for scored in prompt_logprobs:
            client = self.requests.get(scored.request_id)
            if client is not None:
                self._add_prompt_logprobs(client, scored.position, scored.scores)
        touched: dict[str, ClientRequest] = {}
        stops: list[tuple[str, int]] = []
        finishing: list[CompletionState] = []  # final-only completions that end in this step
        for token in outputs:
            client = self.requests.get(token.request_id)
            if client is None:
                continue  # aborted while the step ran
            c = client.completions[token.index]
            if c.finish_reason is not None:
                continue  # a stop string ended it; the core's abort was on its way
            self._process_token(client, c, token, now, finishing)
            if c.finish_reason is not None and token.finish_reason is None:
                stops.append((client.request_id, c.index))
            touched[client.request_id] = client
        if finishing:
            deltas = IncrementalDetokenizer.finish_many(
                [c.detokenizer for c in finishing], [c.undecoded for c in finishing]
            )
            for c, delta in zip(finishing, deltas, strict=True):
                c.text += delta
                c.undecoded = []
        changed = [c for c in touched.values() if not c.final_only or c.is_finished]
        return [self._output(client, now) for client in changed], stops

    def abort(self, request_id: str, now: float) -> RequestOutput | None:
        """The final output of an aborted request (`finish_reason="abort"` for every completion still
        going); None when the request is unknown or done."""
        client = self.requests.get(request_id)
        if client is None:
            return None
        for c in client.completions:
            if c.finish_reason is None:
                c.finish_reason = "abort"
            self._decode_undecoded(c)
        return self._output(client, now)

    def fail(self, request_id: str, message: str, now: float) -> RequestOutput | None:
        """The final output of a request that failed inside the engine (`finish_reason="error"`, and
        `error` says why); None when the request is unknown or done."""
        client = self.requests.get(request_id)
        if client is None:
            return None
        for c in client.completions:
            if c.finish_reason is None:
                c.finish_reason = "error"
            self._decode_undecoded(c)
        output = self._output(client, now)
        output.error = message
        return output

    def _logprob(self, sample: SampleResult) -> Logprob:
        top = [TokenLogprob(t, self.tokenizer.id_to_token(t), lp) for t, lp in sample.top or []]
        return Logprob(
            sample.token_id,
            self.tokenizer.id_to_token(sample.token_id),
            sample.logprob or 0.0,
            top,
            sample.rank,
        )

    def _add_prompt_logprobs(self, client: ClientRequest, position: int, scores: list[SampleResult]) -> None:
        """Scores of prompt tokens from `position` on; a recompute after preemption repeats none."""
        if client.prompt_logprobs is None:
            return
        known = len(client.prompt_logprobs)
        client.prompt_logprobs += [self._logprob(s) for s in scores[max(known - position, 0) :]]

    def _process_token(
        self,
        client: ClientRequest,
        c: CompletionState,
        token: TokenOutput,
        now: float,
        finishing: list[CompletionState],
    ) -> None:
        params, sample = client.params, token.sample
        c.token_ids.append(sample.token_id)
        m = client.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            m.num_cached_tokens = token.num_cached_tokens
        if m.scheduled_time is None and token.scheduled_time is not None:
            m.scheduled_time = token.scheduled_time
        m.last_token_time = now
        if c.logprobs is not None and sample.logprob is not None:
            c.logprobs.append(self._logprob(sample))

        if token.finish_reason == "stop":  # EOS or a stop token id: neither shows in the text
            c.finish_reason, c.stop_reason = "stop", token.stop_reason
        elif client.final_only and not params.stop:
            c.undecoded.append(sample.token_id)
            c.finish_reason = token.finish_reason
        else:
            c.text += c.detokenizer.push([sample.token_id])
            if params.stop:
                start = max(0, c.num_emitted_chars - max(len(s) for s in params.stop))
                found = [(i, s) for s in params.stop if (i := c.text.find(s, start)) != -1]
                if found:
                    index, stop = min(found)
                    c.text = c.text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
                    c.finish_reason, c.stop_reason = "stop", stop
            if c.finish_reason is None and token.finish_reason is not None:
                c.finish_reason = token.finish_reason
        if c.finish_reason is not None and not isinstance(c.stop_reason, str):
            if client.final_only:  # its text is decoded with the others' that end in this step
                finishing.append(c)
            else:
                c.text += c.detokenizer.flush()  # a held-back partial character, if the stream ends in one

    @staticmethod
    def _decode_undecoded(c: CompletionState) -> None:
        if c.undecoded:
            c.text += c.detokenizer.push(c.undecoded)
            c.undecoded = []

    def _output(self, client: ClientRequest, now: float) -> RequestOutput:
        """What changed since the last output (deltas), and on the final output everything (cumulative);
        `prompt_logprobs` on the first output too, where a stream reads them. Copying everything into
        every output made a stream of n tokens cost O(n^2). A finished request is forgotten: its
        completions' lists are handed over, not copied."""
        is_final = client.is_finished
        outputs = []
        for c in client.completions:
            done = c.finish_reason is not None
            visible = len(c.text) if done else len(c.text) - held_back(c.text, client.params.stop)
            visible = max(visible, c.num_emitted_chars)
            out = CompletionOutput(
                index=c.index,
                text_delta=c.text[c.num_emitted_chars : visible],
                token_ids_delta=c.token_ids[c.num_emitted_tokens :],
                logprobs_delta=c.logprobs[c.num_emitted_logprobs :] if c.logprobs is not None else None,
                finish_reason=c.finish_reason,  # type: ignore[arg-type]
                stop_reason=c.stop_reason,
            )
            if is_final:
                out.text, out.token_ids, out.logprobs = c.text, c.token_ids, c.logprobs
            outputs.append(out)
            c.num_emitted_chars = visible
            c.num_emitted_tokens = len(c.token_ids)
            c.num_emitted_logprobs = len(c.logprobs) if c.logprobs is not None else 0
        prompt_logprobs = None
        if client.prompt_logprobs is not None and (is_final or not client.has_output):
            prompt_logprobs = list(client.prompt_logprobs)
        client.has_output = True
        if is_final:
            client.metrics.finished_time = now
            del self.requests[client.request_id]
        return RequestOutput(
            client.request_id,
            client.prompt_token_ids,
            outputs,
            is_final,
            client.metrics,
            client.prompt,
            prompt_logprobs,
        )
