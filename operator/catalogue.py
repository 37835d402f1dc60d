"""How big a model is: a small built-in catalogue of known shapes, and parsing of `8B`-style sizes.

The operator never opens the checkpoint, so profile selection sizes a model from its name (looked up
here) or from the parameter count the user gives. The shape matters twice: weights = parameters x
bytes per parameter, and KV cache per token = 2 (K and V) x layers x KV heads x head dim x bytes.
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    size_label: str  # as people say it: "8B", "70B"
    num_params: int
    num_layers: int
    num_attention_heads: int  # 0 = unknown: every tensor-parallel degree is allowed
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    hidden_size: int
    intermediate_size: int

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def lora_slot_bytes(self, rank: int, tensor_parallel_size: int = 1, dtype_bytes: int = 2) -> int:
        """One GPU's share of one LoRA slot of rank r: A [r, in] and B [out, r] of q, k, v, o, gate, up
        and down in every layer. Sharded as the base layer is: q, k, v, gate, up split their output (B)
        and o, down their input (A) over the ranks; the other factor is whole on every GPU."""
        tp = tensor_parallel_size
        hidden, kv = self.hidden_size, -(-self.num_kv_heads // tp) * self.head_dim
        per_layer = (
            2 * (hidden + hidden // tp)  # q, o
            + 2 * (hidden + kv)  # k, v (KV heads are replicated where TP exceeds them)
            + 3 * (hidden + self.intermediate_size // tp)  # gate, up, down
        )
        return self.num_layers * rank * per_layer * dtype_bytes

    def can_split(self, tensor_parallel_size: int) -> bool:
        """Attention heads are sharded across ranks, so the degree must divide them."""
        heads = self.num_attention_heads
        return heads == 0 or heads % tensor_parallel_size == 0


def _shape(
    name: str,
    label: str,
    params: float,
    layers: int,
    heads: int,
    kv: int,
    dim: int,
    ctx: int,
    hidden: int,
    intermediate: int,
) -> ModelShape:
    return ModelShape(name, label, int(params), layers, heads, kv, dim, ctx, hidden, intermediate)


# Figures from each model's config.json (parameter counts from the model cards); the last two are
# hidden_size and intermediate_size (LoRA slots are sized from them).
CATALOGUE: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _shape("smollm2-135m", "135M", 134.5e6, 30, 9, 3, 64, 8192, 576, 1536),
        _shape("qwen2.5-0.5b", "0.5B", 494e6, 24, 14, 2, 64, 32768, 896, 4864),
        _shape("llama-3.2-1b", "1B", 1.24e9, 16, 32, 8, 64, 131072, 2048, 8192),
        _shape("qwen2.5-1.5b", "1.5B", 1.54e9, 28, 12, 2, 128, 32768, 1536, 8960),
        _shape("llama-3.2-3b", "3B", 3.21e9, 28, 24, 8, 128, 131072, 3072, 8192),
        _shape("mistral-7b", "7B", 7.25e9, 32, 32, 8, 128, 32768, 4096, 14336),
        _shape("qwen2.5-7b", "7B", 7.62e9, 28, 28, 4, 128, 32768, 3584, 18944),
        _shape("llama-3.1-8b", "8B", 8.03e9, 32, 32, 8, 128, 131072, 4096, 14336),
        _shape("qwen2.5-14b", "14B", 14.8e9, 48, 40, 8, 128, 32768, 5120, 13824),
        _shape("qwen2.5-32b", "32B", 32.8e9, 64, 40, 8, 128, 32768, 5120, 27648),
        _shape("llama-3.1-70b", "70B", 70.6e9, 80, 64, 8, 128, 131072, 8192, 28672),
        _shape("qwen2.5-72b", "72B", 72.7e9, 80, 64, 8, 128, 32768, 8192, 29568),
        _shape("llama-3.1-405b", "405B", 405.9e9, 126, 128, 8, 128, 131072, 16384, 53248),
    )
}

# Names people use for the same checkpoints.
_ALIASES = {
    "llama-3-8b": "llama-3.1-8b",
    "llama-3.3-70b": "llama-3.1-70b",
    "llama-3-70b": "llama-3.1-70b",
    "mistral-7b-v0.3": "mistral-7b",
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def catalogue_key(name: str) -> str:
    """`meta-llama/Llama-3.1-8B-Instruct` -> `llama-3.1-8b`: drop the org and the tuning suffix."""
    key = name.strip().lower().rsplit("/", 1)[-1]
    key = re.sub(r"[-_.](instruct|chat|it|base|hf|fp8|awq|gptq)$", "", key)
    key = re.sub(r"^(meta-)", "", key)
    return _ALIASES.get(key, key)


def lookup(name: str) -> ModelShape | None:
    return CATALOGUE.get(catalogue_key(name))


def parse_num_params(text: str | int | float) -> int:
    """`"8B"` -> 8e9, `"135M"` -> 135e6, `7000000000` -> 7e9."""
    if isinstance(text, int | float):
        value = int(text)
    else:
        match = _SIZE.match(text)
        if not match:
            raise ValueError(f"model size {text!r}: expected a parameter count like 8B, 70B, 135M")
        value = int(float(match.group(1)) * _SCALE[match.group(2).lower()])
    if value <= 0:
        raise ValueError(f"model size {text!r}: must be positive")
    return value


def size_label(num_params: int) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if num_params >= scale:
            value = num_params / scale
            return f"{value:.0f}{suffix}" if value >= 10 else f"{value:.2g}{suffix}"
    return str(num_params)


def resolve(name: str, parameters: str | int | None = None) -> ModelShape:
    """The shape of a model: from the catalogue, or estimated from a parameter count.

    An unknown model with a parameter count borrows the layer/head layout of the catalogue entry
    nearest in size (KV cache grows roughly with depth x width), and allows any TP degree.
    """
    known = lookup(name)
    if parameters is None:
        if known is None:
            names = ", ".join(sorted(CATALOGUE))
            raise ValueError(f"model {name!r} is not in the built-in catalogue ({names}): give its size")
        return known
    num_params = parse_num_params(parameters)
    label = parameters if isinstance(parameters, str) else size_label(num_params)
    if known is not None:
        return dataclasses.replace(known, num_params=num_params, size_label=label.strip().upper())
    nearest = min(CATALOGUE.values(), key=lambda s: abs(s.num_params - num_params))
    return dataclasses.replace(
        nearest,
        name=name,
        size_label=label.strip().upper(),
        num_params=num_params,
        num_attention_heads=0,
    )
