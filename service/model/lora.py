"""LoRA adapters in PEFT's format, and the decoder projections that add theirs to the base output.

An adapter folder holds `adapter_config.json` (r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` (`...layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and `lora_B.weight`
[out, r]). `read_adapter` checks it against the base model (rank, target modules, shapes) and keeps
its tensors on the host; `LoRALinear` wraps one of the model's projections with `num_slots` adapter
slots: y = base(x) + B_slot(A_slot(x)) for each token's slot (-1: none), through the batched kernels
(`kernels.lora_shrink` / `lora_expand`). A merged projection (q/k/v, gate/up) has one A and one B per
part, so each part's adapter stays its own.

Under tensor parallelism a column-parallel projection keeps its rows of each part's B (A whole); a
row-parallel one (o, down) its columns of A (B whole): the partial shrinks are summed over the ranks
(a [parts, tokens, rank] all-reduce, small) and each rank adds the whole update to the reduced output.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagoda import kernels
from pagoda.service.model.config import ModelConfig
from pagoda.service.model.parallel import Shard, TPGroup

# PEFT's module names -> (our projection, its part).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class LoRAError(ValueError):
    """An adapter that cannot be served with this model and these limits (the API's 400)."""


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in features, out features) of the base model's projection."""
    h, hd = config.hidden_size, config.head_dim
    q, kv, inter = config.num_attention_heads * hd, config.num_key_value_heads * hd, config.intermediate_size
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
    }  # fmt: skip


@dataclass
class LoRAAdapter:
    """One adapter's tensors on the host, whole (not sharded): (layer, PEFT module) -> (A [r, in],
    B [out, r] already multiplied by the scaling)."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _target_modules(raw: Any) -> set[str]:
    if isinstance(raw, str):  # PEFT: a regex over full module names, or "all-linear"
        if raw == "all-linear":
            return set(TARGETS)
        raise LoRAError(f"target_modules {raw!r}: give the module names as a list")
    return {str(m).rsplit(".", 1)[-1] for m in raw or ()}


def read_adapter(path: str | Path, name: str, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """An adapter folder in PEFT's format, checked against the base model; LoRAError says what does
    not fit (a rank above `max_rank`, a module the model lacks, a shape of another model)."""
    from safetensors import safe_open

    folder = Path(path)
    config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise LoRAError(f"{path}: no adapter_config.json and adapter_model.safetensors (PEFT's format)")
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LoRAError(f"{config_path}: {exc}") from exc
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{path}: a {cfg.get('peft_type')} adapter; only LoRA is served")
    rank = int(cfg.get("r", 0))
    if not 1 <= rank <= max_rank:
        raise LoRAError(f"{path}: rank {rank} is above --max-lora-rank {max_rank}" if rank > max_rank
                        else f"{path}: rank {rank} is not positive")  # fmt: skip
    unsupported = [
        key
        for key in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "fan_in_fan_out")
        if cfg.get(key)
    ]
    if cfg.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise LoRAError(f"{path}: {', '.join(unsupported)} is not supported (plain LoRA only)")
    targets = _target_modules(cfg.get("target_modules"))
    if missing := sorted(targets - set(TARGETS)):
        raise LoRAError(
            f"{path}: target modules {', '.join(missing)} are not in the model's decoder projections "
            f"({', '.join(TARGETS)})"
        )
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    shapes = module_shapes(config)
    adapter = LoRAAdapter(name, str(path), rank)
    with safe_open(weights_path, framework="pt") as f:
        names = set(f.keys())
        for key in sorted(names):
            if not key.endswith(".lora_A.weight"):
                if not key.endswith(".lora_B.weight"):
                    raise LoRAError(f"{path}: tensor {key} is not a LoRA A or B weight")
                continue
            parts = key.split(".")
            try:
                layer = int(parts[parts.index("layers") + 1])
            except (ValueError, IndexError) as exc:
                raise LoRAError(f"{path}: tensor {key} names no decoder layer") from exc
            module = parts[-3]
            if module not in TARGETS:
                raise LoRAError(f"{path}: tensor {key}: {module} is not a decoder projection")
            if not 0 <= layer < config.num_hidden_layers:
                raise LoRAError(f"{path}: tensor {key}: the model has {config.num_hidden_layers} layers")
            b_key = key.replace(".lora_A.", ".lora_B.")
            if b_key not in names:
                raise LoRAError(f"{path}: {key} has no {b_key}")
            a, b = f.get_tensor(key).float(), f.get_tensor(b_key).float()
            fan_in, fan_out = shapes[module]
            if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
                raise LoRAError(
                    f"{path}: {module} of layer {layer} is A {tuple(a.shape)}, B {tuple(b.shape)}; this "
                    f"model wants A ({rank}, {fan_in}), B ({fan_out}, {rank}) (an adapter of another model?)"
                )
            adapter.weights[(layer, module)] = (a, b * scaling)
    if not adapter.weights:
        raise LoRAError(f"{path}: the adapter holds no LoRA weights")
    return adapter


@dataclass
class LoRABatch:
    """The adapters of the step being run, shared by every `LoRALinear` of the model: each token's
    slot, the runs of tokens sharing one (None: one token per sequence, a decode), and whether any
    token has an adapter (False: the projections skip the kernels)."""

    token_slots: torch.Tensor | None = None  # [num_tokens] int32
    segments: kernels.LoraSegments | None = None
    active: bool = False


class LoRALinear(nn.Module):
    """A projection plus `num_slots` adapter slots of rank up to `max_rank`. `parts`: this rank's
    output rows of each part (a merged projection has several) as checkpoint shards; `row_shard`: for
    a row-parallel projection, this rank's columns of the input."""

    def __init__(
        self,
        base: nn.Module,
        batch: LoRABatch,
        num_slots: int,
        max_rank: int,
        in_features: int,
        parts: tuple[Shard, ...],
        row_shard: Shard | None,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.batch = batch
        self.parts = parts
        self.row_shard = row_shard
        self.tp = tp
        starts = [0]
        for part in parts:
            starts.append(starts[-1] + part.size)
        self.slice_starts = tuple(starts)
        self.a = torch.zeros(num_slots, len(parts), max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, starts[-1], max_rank, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.batch
        if not batch.active:
            return y
        assert batch.token_slots is not None
        v = kernels.lora_shrink(x, self.a, batch.token_slots, batch.segments)
        if self.row_shard is not None and self.tp.size > 1:
            self.tp.all_reduce(v)  # the partial products of each rank's input columns
        kernels.lora_expand(v, self.b, batch.token_slots, y, self.slice_starts, batch.segments)
        return y

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter's (A [r, in], B [out, r]) of each part, whole, into `slot` (this rank's
        shard of them; None: the adapter leaves that part alone); ranks past r stay zero."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for i, (weights, shard) in enumerate(zip(parts, self.parts, strict=True)):
            if weights is None:
                continue
            a, b = weights
            r = a.shape[0]
            if self.row_shard is not None:
                a = a[:, self.row_shard.start : self.row_shard.stop]
            else:
                b = b[shard.start : shard.stop]
            self.a[slot, i, :r].copy_(a)
            self.b[slot, self.slice_starts[i] : self.slice_starts[i + 1], :r].copy_(b)


def _layout(config: ModelConfig, tp: TPGroup) -> dict[str, tuple[int, tuple[Shard, ...], Shard | None]]:
    """Projection -> (this rank's input features, its output rows of each part, its input columns when
    row-parallel), as `llama.py` shards the base weights."""
    hd, rank, size = config.head_dim, tp.rank, tp.size
    q_size = config.num_attention_heads * hd // size
    kv_size = max(config.num_key_value_heads // size, 1) * hd
    first_kv = rank * config.num_key_value_heads // size * hd
    inter = config.intermediate_size // size
    h = config.hidden_size
    return {
        "self_attn.qkv_proj": (h, (Shard(0, rank * q_size, q_size), Shard(0, first_kv, kv_size),
                                   Shard(0, first_kv, kv_size)), None),
        "self_attn.o_proj": (q_size, (Shard(0, 0, h),), Shard(1, rank * q_size, q_size)),
        "mlp.gate_up_proj": (h, (Shard(0, rank * inter, inter),) * 2, None),
        "mlp.down_proj": (inter, (Shard(0, 0, h),), Shard(1, rank * inter, inter)),
    }  # fmt: skip


def attach_lora(
    model: nn.Module,
    config: ModelConfig,
    num_slots: int,
    max_rank: int,
    tp: TPGroup,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[LoRABatch, list[dict[str, LoRALinear]]]:
    """Wrap every decoder layer's projections in `LoRALinear`; returns the batch state they share and,
    per layer, projection name -> its wrapper. The wrappers are not `Fp8Linear`s: an fp8 base
    quantizes its own inputs and applies its own scales (the adapters need the real activations and
    add to the scaled output), as `fp8.fuse_input_quantization` decides once they are in place."""
    from pagoda.service.model.fp8 import fuse_input_quantization

    batch = LoRABatch()
    layers: list[dict[str, LoRALinear]] = []
    layout = _layout(config, tp)
    for layer in model.model.layers:  # type: ignore[union-attr, attr-defined]
        wrapped: dict[str, LoRALinear] = {}
        for name, (in_features, parts, row_shard) in layout.items():
            owner_name, attr = name.split(".")
            owner = getattr(layer, owner_name)
            wrapper = LoRALinear(
                getattr(owner, attr),
                batch,
                num_slots,
                max_rank,
                in_features,
                parts,
                row_shard,
                tp,
                dtype,
                device,
            )
            setattr(owner, attr, wrapper)
            wrapped[name] = wrapper
        fuse_input_quantization(layer)
        layers.append(wrapped)
    return batch, layers


def load_into_slot(layers: list[dict[str, LoRALinear]], slot: int, adapter: LoRAAdapter | None) -> None:
    """Write `adapter` (None: nothing, an empty slot) into `slot` of every projection."""
    for index, wrapped in enumerate(layers):
        for name, wrapper in wrapped.items():
            modules = [m for m, (target, _) in TARGETS.items() if target == name]
            weights = [adapter.weights.get((index, m)) if adapter is not None else None for m in modules]
            wrapper.set_slot(slot, weights)
