"""A stand-in model side, for benchmarks only: no forward pass, every sampled token is ready at once.

With `pagoda serve --executor-class pagoda.service.engine.runner.null_executor:NullExecutor`, the real
API process and the real engine core (scheduler, KV blocks, step loop, messages) run around this instead
of the model, so `pagoda bench serve` against it measures what everything but the GPU can stream: the
ceiling the API process puts on served throughput. Tokens cycle through ordinary ids of the model's
vocabulary (never an end of sequence), so detokenizing costs what it costs with real text. The model's
config and tokenizer are read as usual; the weights are loaded (on the CPU) only for their config, and
the KV cache is a layout with nothing behind it.

`...null_executor:PacedNullExecutor` makes every step take at least 10 ms (a sleep), the pace of an
H200's decode step at concurrency ~64, so the API process sees the message rate of a GPU server rather
than a step every ~0.5 ms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.core.request import Request
from pagoda.service.engine.core.scheduler import SchedulerOutput
from pagoda.service.engine.messages import SampleResult
from pagoda.service.engine.runner.model_runner import KVCacheLayout, StepResult

_VIRTUAL_KV_TOKENS = 1 << 22  # room for 4M tokens of context: the cache never limits the batch


@dataclass
class _Done:
    done: StepResult

    def result(self) -> StepResult:
        return self.done


class NullExecutor:
    """The executor protocol without a model (see the module docstring)."""

    can_overlap = False
    step_s = 0.0  # the least a step takes

    def __init__(
        self, config: EngineConfig, eos_token_ids: set[int], relay_stop_signals: bool = False
    ) -> None:
        from pagoda.service.model.loader import load_model

        _, self.model_config = load_model(config.model_path, "auto", "cpu")
        self.device = torch.device("cpu")  # what `pagoda bench offline` reads off a runner
        self.dtype = "no model (null executor)"
        block_size = config.block_size
        self.kv = KVCacheLayout(_VIRTUAL_KV_TOKENS // block_size, block_size, 1)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        # Ordinary ids from the middle of the vocabulary: words and word pieces, not specials.
        vocab = self.model_config.vocab_size
        self._cycle = [t for t in range(vocab // 4, vocab // 4 + 97) if t not in eos_token_ids]
        self._next = 0

    def execute(self, out: SchedulerOutput) -> StepResult:
        if self.step_s:
            time.sleep(self.step_s)
        sampled: dict[str, SampleResult] = {}
        for i, req in enumerate(out.requests):
            if out.needs_sample(i):
                sampled[req.request_id] = SampleResult(self._cycle[self._next % len(self._cycle)])
                self._next += 1
        return StepResult(sampled, {})

    def forward(self, out: SchedulerOutput, after: object = None) -> SchedulerOutput:
        return out

    def sample(self, forwarded: SchedulerOutput, grammar: object = None) -> _Done:
        return _Done(self.execute(forwarded))

    def propose_drafts(self, reqs: list[Request], k: list[int]) -> list[list[int]]:
        raise ValueError("the null executor has no draft model")

    def add_lora(self, name: str, path: str) -> None:
        raise ValueError("the null executor has no model to adapt")

    def check_alive(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class PacedNullExecutor(NullExecutor):
    """The null model at a GPU's pace: every step takes at least 10 ms."""

    step_s = 0.010
