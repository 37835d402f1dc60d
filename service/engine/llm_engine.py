"""The synchronous engine: admit requests, run steps, hand back outputs.

One client request (possibly n > 1 completions) maps to n `Request` sequences; the first is the
leader that computes the shared prompt, the others fork from it. Turning tokens into text and
outputs is the output processor's job.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pagoda.service.engine.block_manager import BlockManager
from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.model_runner import ModelRunner
from pagoda.service.engine.output_processor import ClientRequest, OutputProcessor
from pagoda.service.engine.request import Request
from pagoda.service.engine.scheduler import Scheduler
from pagoda.service.model import default_model_path, load_tokenizer
from pagoda.service.outputs import RequestOutput
from pagoda.service.sampling_params import InvalidRequestError, SamplingParams
from pagoda.service.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    num_kv_blocks: int
    block_size: int
    num_preemptions_total: int
    prefix_cache_queries_total: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int  # of which found
    prompt_tokens_total: int
    generation_tokens_total: int


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_path = str(config.model) if config.model else str(default_model_path())
        self.tokenizer: Tokenizer = load_tokenizer(model_path)
        self.runner = ModelRunner(config, model_path, self.tokenizer.eos_token_ids)
        self.max_model_len = self.runner.max_model_len
        self.model_name = config.served_model_name or model_path.rstrip("/").split("/")[-1]
        self.block_manager = BlockManager(
            self.runner.kv.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self._requests: dict[str, ClientRequest] = {}
        self._seq_owner: dict[str, ClientRequest] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.computed_tokens_total = 0  # tokens run through the model (prefix-cache hits are not)

    # ---- admission -----------------------------------------------------------------------------

    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Check the request and tokenize it; raise `InvalidRequestError` before it touches anything."""
        params.validate()
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            vocab = self.runner.model_config.vocab_size
            bad = [t for t in token_ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"token ids out of range [0, {vocab}): {bad[:5]}", param="prompt")
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{len(token_ids)} tokens; shorten the prompt",
                param="prompt",
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(token_ids)} tokens and max_tokens is {params.max_tokens} (at most {room} fit)",
                param="max_tokens",
            )
        return token_ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        validated_token_ids: list[int] | None = None,
    ) -> None:
        """Queue a request. `validated_token_ids`: the result of an earlier `validate(prompt, params)`."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        token_ids = validated_token_ids if validated_token_ids is not None else self.validate(prompt, params)
        now = time.monotonic() if arrival_time is None else arrival_time
        seqs = [Request(f"{request_id}#{i}", token_ids, params, now, index=i) for i in range(params.n)]
        seqs[0].pending_forks = seqs[1:]
        client = self.output_processor.new_request(
            request_id, prompt if isinstance(prompt, str) else None, seqs, params, now
        )
        self._requests[request_id] = client
        for s in seqs:
            self._seq_owner[s.request_id] = client
        self.scheduler.add(seqs[0])
        self.prompt_tokens_total += len(token_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request at once and free its blocks; its final output says `finish_reason="abort"`
        for every completion that had not finished (None: no such request, or already done)."""
        client = self._requests.get(request_id)
        if client is None:
            return None
        for c in client.completions:
            if c.finish_reason is None:
                c.finish_reason = "abort"
            self.scheduler.finish(c.seq)
        return self._output(client, time.monotonic())

    # ---- stepping ------------------------------------------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every client request that changed."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        now = time.monotonic()
        for req in out.requests:
            client = self._seq_owner[req.request_id]
            if client.metrics.scheduled_time is None:
                client.metrics.scheduled_time = now
        self.computed_tokens_total += out.total_num_tokens
        step = self.runner.execute(out)
        sampled = step.sampled
        for request_id, (position, scores) in step.prompt_logprobs.items():
            self.output_processor.add_prompt_logprobs(self._seq_owner[request_id], position, scores)
        grew = self.scheduler.update(out, {k: v.token_id for k, v in sampled.items()})
        now = time.monotonic()
        touched: dict[str, ClientRequest] = {}  # in batch order
        for seq in grew:
            client = self._seq_owner[seq.request_id]
            self.generation_tokens_total += 1
            if self.output_processor.process_token(
                client, client.completions[seq.index], sampled[seq.request_id], now
            ):
                self.scheduler.finish(seq)
            touched[client.request_id] = client
        return [self._output(client, now) for client in touched.values()]

    def _output(self, client: ClientRequest, now: float) -> RequestOutput:
        output = self.output_processor.make_output(client, now)
        if output.finished:
            self._requests.pop(client.request_id, None)
            for c in client.completions:
                self._seq_owner.pop(c.seq.request_id, None)
        return output

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
