"""The engine in one process: the API-side processors and the engine core, stepped by the caller.

The offline `LLM`, `pagoda bench offline` and the tests use it. `pagoda serve` runs the same pieces
split in two: the processors in the API process (`AsyncEngine`), the core in its own process.
"""

from __future__ import annotations

import time

from pagoda.service.engine.client.input_processor import InputProcessor
from pagoda.service.engine.client.output_processor import OutputProcessor
from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.core.block_manager import BlockManager
from pagoda.service.engine.core.engine_core import EngineCore
from pagoda.service.engine.core.scheduler import Scheduler
from pagoda.service.engine.messages import AddRequest, EngineStats
from pagoda.service.engine.runner.executor import build_executor
from pagoda.service.errors import InvalidRequestError
from pagoda.service.model import load_tokenizer
from pagoda.service.outputs import RequestOutput
from pagoda.service.sampling_params import SamplingParams
from pagoda.service.tokenizer import Tokenizer

__all__ = ["EngineStats", "LLMEngine"]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer: Tokenizer = load_tokenizer(config.model_path)
        self.runner = build_executor(config, self.tokenizer.eos_token_ids)
        self.core = EngineCore(
            config, self.runner, self.tokenizer.eos_token_ids, load_tokenizer=lambda: self.tokenizer
        )
        self.max_model_len = self.core.max_model_len
        self.model_name = config.model_name
        self.input_processor = InputProcessor(
            self.tokenizer, self.runner.model_config.vocab_size, self.max_model_len
        )
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)

    @property
    def block_manager(self) -> BlockManager:
        return self.core.block_manager

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def computed_tokens_total(self) -> int:
        return self.core.computed_tokens_total

    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Check the request and tokenize it; raise `InvalidRequestError` before it touches anything."""
        return self.input_processor.process(prompt, params)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        validated_token_ids: list[int] | None = None,
        final_only: bool = False,
        lora_name: str | None = None,
    ) -> None:
        """Queue a request. `validated_token_ids`: the result of an earlier `validate(prompt, params)`.
        `final_only`: `step` returns its output once, when it finishes (`LLM.generate`). `lora_name`:
        a LoRA adapter the core serves (`core.lora_op` loads one)."""
        if request_id in self.output_processor.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        token_ids = validated_token_ids if validated_token_ids is not None else self.validate(prompt, params)
        now = time.monotonic() if arrival_time is None else arrival_time
        self.output_processor.add_request(
            request_id, prompt if isinstance(prompt, str) else None, token_ids, params, now, final_only
        )
        self.core.add_request(AddRequest(request_id, token_ids, params, now, lora_name))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request at once and free its blocks; its final output says `finish_reason="abort"`
        for every completion that had not finished (None: no such request, or already done)."""
        self.core.abort(request_id)
        return self.output_processor.abort(request_id, time.monotonic())

    @property
    def has_unfinished(self) -> bool:
        return bool(self.output_processor.requests)

    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every client request that changed (a final-only one's
        when it finishes)."""
        step = self.core.step()
        now = time.monotonic()
        outputs, stops = self.output_processor.process(step.tokens, step.prompt_logprobs, now)
        for request_id, index in stops:
            self.core.abort(request_id, index)
        for failure in step.failures + self.core.take_lora_failures():  # ended by the core: finals say why
            final = self.output_processor.fail(failure.request_id, failure.message, now)
            if final is not None:
                outputs.append(final)
        return outputs

    def stats(self) -> EngineStats:
        return self.core.stats()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op with one rank) and close the KV-events sockets;
        idempotent."""
        self.core.close()
        self.runner.shutdown()
