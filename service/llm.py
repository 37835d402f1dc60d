"""The offline API, in the spirit of vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pagoda.service.engine.config import EngineConfig, LoRAConfig, SpeculativeConfig
from pagoda.service.engine.llm_engine import LLMEngine
from pagoda.service.outputs import RequestOutput
from pagoda.service.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """vLLM's: generate under the LoRA adapter at `lora_path` (a PEFT folder), known as `lora_name`;
    loaded at its first use. `lora_int_id` is vLLM's numbering, kept for its callers (unused)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class LLM:
    def __init__(
        self,
        model: str | None = None,
        speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        **engine_args: Any,
    ) -> None:
        """`model`: a checkpoint folder or .gguf file (None: the embedded SmolLM2). `speculative_config`:
        vLLM's, as a dict (the fields of `SpeculativeConfig`). `enable_lora` and its limits: vLLM's
        (`generate(..., lora_request=...)`). `engine_args`: the fields of `EngineConfig`."""
        if enable_lora:
            engine_args["lora"] = LoRAConfig((), max_loras, max_lora_rank, max_cpu_loras)
        if isinstance(speculative_config, dict):
            speculative_config = SpeculativeConfig.from_json(json.dumps(speculative_config))
        if speculative_config is not None:
            engine_args["speculative"] = speculative_config
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_args) - fields)
        if unknown:
            raise ValueError(f"unknown engine arguments {unknown}; known: {sorted(fields)}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers; `with LLM(...) as llm:` does it on exit."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prompt prefixes (see `BlockManager.reset_prefix_cache`); False while
        requests are running, which `generate` never leaves behind."""
        return self.engine.block_manager.reset_prefix_cache()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs come back in the prompts' order.
        `lora_request`: one adapter for every prompt, or one (or None: the base model) per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None:
            params = SamplingParams()
        param_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(param_list)} sampling params")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        # Validate everything before queueing anything.
        token_ids = [self.engine.validate(p, sp) for p, sp in zip(prompts, param_list, strict=True)]
        for needed in {r for r in loras if r is not None}:
            self._load_lora(needed)
        ids = [f"offline-{i}" for i in range(len(prompts))]
        for rid, prompt, sp, toks, lora in zip(ids, prompts, param_list, token_ids, loras, strict=True):
            name = lora.lora_name if lora is not None else None
            self.engine.add_request(
                rid, prompt, sp, validated_token_ids=toks, final_only=True, lora_name=name
            )  # type: ignore[arg-type]
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished:
            for out in self.engine.step():  # final-only requests: each output is a finished one
                final[out.request_id] = out
        return [final[rid] for rid in ids]

    def _load_lora(self, lora: LoRARequest) -> None:
        """Load an adapter at its first use (a name known under another path: load that path again)."""
        core = self.engine.core
        known = core.lora_slots.adapters.get(lora.lora_name) if core.lora_slots is not None else None
        if known == lora.lora_path:
            return
        if known is not None:
            core.lora_op(lora.lora_name, None)
        if error := core.lora_op(lora.lora_name, lora.lora_path):
            raise ValueError(error)

    def unload_lora(self, name: str) -> None:
        if error := self.engine.core.lora_op(name, None):
            raise ValueError(error)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        # The template already holds the special tokens: encode without adding them again.
        prompts = [
            self.tokenizer.encode(self.tokenizer.apply_chat_template(c), add_special_tokens=False)
            for c in conversations
        ]
        return self.generate(prompts, params)
