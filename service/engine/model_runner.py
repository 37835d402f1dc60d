"""The one torch-heavy engine file: owns the model and the KV cache tensors, turns a
`SchedulerOutput` into one flattened forward pass (no padding), and samples the rows that need it."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.sampler import Sampler, SampleResult
from pagoda.service.engine.scheduler import SchedulerOutput
from pagoda.service.model import load_model
from pagoda.service.model.attention import AttentionMetadata

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 512 << 20
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but no CUDA device is available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


@dataclass(frozen=True)
class KVCacheLayout:
    num_blocks: int
    block_size: int
    bytes_per_block: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, eos_token_ids: set[int]) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        self.model, self.model_config = load_model(model_path, dtype=self.dtype, device=self.device)
        mc = self.model_config
        self.kv = self._kv_cache_layout()
        self.kv_cache = torch.empty(
            2,
            mc.num_hidden_layers,
            self.kv.num_blocks,
            config.block_size,
            mc.num_key_value_heads,
            mc.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        for i, layer in enumerate(self.model.attention_layers()):
            layer.k_cache = self.kv_cache[0, i]
            layer.v_cache = self.kv_cache[1, i]
        self.sampler = Sampler(mc.vocab_size, eos_token_ids)
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s on %s)",
            self.kv.num_blocks,
            config.block_size,
            self.kv.num_tokens,
            self.kv.num_blocks * self.kv.bytes_per_block / 2**20,
            self.dtype,
            self.device,
        )

    def _kv_cache_layout(self) -> KVCacheLayout:
        mc, cfg = self.model_config, self.config
        element_size = torch.empty(0, dtype=self.dtype).element_size()
        bytes_per_block = 2 * mc.num_hidden_layers * cfg.block_size * mc.num_key_value_heads * mc.head_dim
        bytes_per_block *= element_size
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            # Activations of the largest step and the sampler's float32 logits stay outside the cache.
            activations = cfg.max_num_batched_tokens * (4 * mc.hidden_size + 3 * mc.intermediate_size)
            activations = activations * element_size + 3 * cfg.max_num_seqs * mc.vocab_size * 4
            budget = int(free * cfg.gpu_memory_utilization) - activations - (512 << 20)
        else:
            budget = _CPU_DEFAULT_KV_BYTES
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"no room for the KV cache: the budget is {budget / 2**20:.1f} MiB and one block of "
                f"{cfg.block_size} tokens takes {bytes_per_block / 2**20:.2f} MiB"
            )
        return KVCacheLayout(int(num_blocks), cfg.block_size, bytes_per_block)

    # ---- one step ------------------------------------------------------------------------------

    def _prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        reqs, counts = out.requests, np.asarray(out.num_scheduled_tokens, dtype=np.int64)
        starts = np.asarray([r.num_computed_tokens for r in reqs], dtype=np.int64)
        query_start_loc = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        input_ids = np.fromiter(
            (t for r, s, n in zip(reqs, starts, counts, strict=True) for t in r.token_ids[s : s + n]),
            dtype=np.int64,
            count=total,
        )
        row = np.repeat(np.arange(len(reqs)), counts)
        positions = np.arange(total) - query_start_loc[:-1][row] + starts[row]
        width = max(len(r.block_ids) for r in reqs)
        block_tables = np.zeros((len(reqs), width), dtype=np.int32)
        for i, r in enumerate(reqs):
            block_tables[i, : len(r.block_ids)] = r.block_ids
        bs = self.kv.block_size
        slot_mapping = block_tables[row, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = starts + counts

        def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(a).to(device=self.device, dtype=dtype, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=dev(slot_mapping, torch.int64),
            block_tables=dev(block_tables, torch.int32),
            seq_lens=dev(seq_lens, torch.int32),
            query_start_loc=dev(query_start_loc, torch.int32),
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
        )
        return dev(input_ids, torch.int64), dev(positions, torch.int64), meta

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampleResult]:
        """Run one step; return the sampled token of every request that reached its last token."""
        for src, dst in out.copy_ops:
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
        input_ids, positions, meta = self._prepare(out)
        hidden = self.model(input_ids, positions, meta)
        rows = [i for i in range(len(out.requests)) if out.needs_sample(i)]
        if not rows:
            return {}
        last = meta.query_start_loc[1:][torch.tensor(rows, device=self.device)].long() - 1
        logits = self.model.compute_logits(hidden[last])
        sample_reqs = [out.requests[i] for i in rows]
        results = self.sampler(logits, sample_reqs)
        return {r.request_id: res for r, res in zip(sample_reqs, results, strict=True)}
