"""One rank's LoRA adapters: host copies (least recently used leave past `--max-cpu-loras`), the
model's GPU slots (`model/lora.py`), and each step's token -> slot map.

The core decides which adapter sits in which slot (core/lora_slots.py) and sends the placements with
the step; every rank writes them into its slots before the forward pass, from its host copy, or
from the folder when the copy was evicted (the files were checked when the adapter was added).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagoda import kernels
from pagoda.service.engine.config import LoRAConfig
from pagoda.service.engine.runner.sampler import to_device
from pagoda.service.model.config import ModelConfig
from pagoda.service.model.lora import LoRAAdapter, attach_lora, load_into_slot, read_adapter
from pagoda.service.model.parallel import TPGroup

logger = logging.getLogger(__name__)


class LoRARunner:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        config: LoRAConfig,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.device = device
        self.batch, self.layers = attach_lora(
            model, model_config, config.max_loras, config.max_lora_rank, tp, dtype, device
        )
        self._host: OrderedDict[tuple[str, str], LoRAAdapter] = OrderedDict()
        self.token_slots = np.zeros(0, dtype=np.int32)  # the step's, each token's slot (host)

    def add(self, name: str, path: str) -> LoRAAdapter:
        """Read and check an adapter, and keep it on the host; LoRAError (a ValueError) says why not."""
        adapter = read_adapter(path, name, self.model_config, self.config.max_lora_rank)
        self._keep(adapter)
        logger.info(
            "LoRA adapter %s: rank %d, %.1f MiB, from %s", name, adapter.rank, adapter.num_bytes / 2**20, path
        )
        return adapter

    def load(self, placements: list[tuple[int, str, str]]) -> None:
        """Write the core's placements (slot, name, path) into the model's slots."""
        for slot, name, path in placements:
            adapter = self._host.get((name, path))
            if adapter is None:
                adapter = self.add(name, path)
            else:
                self._host.move_to_end((name, path))
            load_into_slot(self.layers, slot, adapter)

    def set_step(self, batch: dict[str, np.ndarray]) -> None:
        """The step's token -> slot map for the projections: `batch["lora_slots"]` holds each request's
        slot (-1: none); a decode (one row per request) runs one token at a time, anything else over
        runs of tokens that share a slot."""
        slots = batch["lora_slots"]
        starts = batch["query_start_loc"]
        self.token_slots = np.repeat(slots, np.diff(starts)).astype(np.int32)  # what a CUDA graph copies
        state = self.batch
        state.active = bool((slots >= 0).any())
        if not state.active:
            state.token_slots, state.segments = None, None
            return
        state.token_slots = to_device(self.token_slots, torch.int32, self.device)
        if int(batch["max_query_len"]) == 1:
            state.segments = None
            return
        # Runs: consecutive requests with the same slot merge into one.
        first = np.flatnonzero(np.r_[True, slots[1:] != slots[:-1]])
        run_starts = np.r_[starts[first], starts[-1]].astype(np.int32)
        state.segments = kernels.LoraSegments(
            to_device(run_starts, torch.int32, self.device),
            to_device(slots[first].astype(np.int32), torch.int32, self.device),
            int(np.diff(run_starts).max()),
        )

    def clear(self) -> None:
        """No adapter in the next step until `set_step` says otherwise (after the warm-up's)."""
        self.token_slots = np.zeros(0, dtype=np.int32)
        self.batch.active, self.batch.token_slots, self.batch.segments = False, None, None

    def _keep(self, adapter: LoRAAdapter) -> None:
        key = (adapter.name, adapter.path)
        self._host[key] = adapter
        self._host.move_to_end(key)
        while len(self._host) > self.config.cpu_capacity:
            evicted, _ = self._host.popitem(last=False)
            logger.info(
                "LoRA adapter %s leaves host memory (--max-cpu-loras %d)",
                evicted[0],
                self.config.cpu_capacity,
            )
