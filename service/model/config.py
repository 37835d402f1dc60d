"""The model's shape, normalised from a Hugging Face `config.json` or from GGUF metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Hugging Face architecture name -> whether q/k/v projections carry a bias.
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
# GGUF `general.architecture` -> the Hugging Face architecture it stands for.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
ROPE_TYPES = ("default", "linear", "llama3")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # with "rope_type" in ROPE_TYPES; None for plain rope
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: torch.dtype  # the checkpoint's dtype, what dtype="auto" loads
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Mistral v0.1 attends to the last 4096 positions only; the model attends to all, so the engine
    # must clamp the context length to this window (equal outputs up to it).
    sliding_window: int | None = None

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        """From the parsed `config.json` (and `generation_config.json`, whose token ids win)."""
        architectures = raw.get("architectures") or [raw.get("model_type", "<none>")]
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model architecture {architecture!r}; supported: "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        num_heads = raw["num_attention_heads"]
        rope_theta, rope_scaling = _rope_from_hf(raw)
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        if dtype_name not in _DTYPES:
            raise ValueError(f"unsupported checkpoint dtype {dtype_name!r}; supported: {sorted(_DTYPES)}")
        generation = generation or {}
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        bos = generation.get("bos_token_id", raw.get("bos_token_id"))
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=SUPPORTED_ARCHITECTURES[architecture] or bool(raw.get("attention_bias", False)),
            torch_dtype=_DTYPES[dtype_name],
            eos_token_ids=_ids(eos),
            bos_token_id=bos,
            sliding_window=_sliding_window(raw),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"model config not found: {config_path}")
        generation_path = folder / "generation_config.json"
        generation = json.loads(generation_path.read_text()) if generation_path.is_file() else None
        return cls.from_hf_dict(json.loads(config_path.read_text()), generation)

    @classmethod
    def from_gguf_metadata(
        cls, meta: dict[str, Any], vocab_size: int, has_output_weight: bool, torch_dtype: torch.dtype
    ) -> ModelConfig:
        """From a GGUF file's metadata (keys prefixed by `general.architecture`, e.g. `llama.*`)."""
        arch = meta.get("general.architecture", "<none>")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}"
            )
        hidden = int(meta[f"{arch}.embedding_length"])
        num_heads = int(meta[f"{arch}.attention.head_count"])
        scaling_type = meta.get(f"{arch}.rope.scaling.type")
        rope_scaling = None
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
        elif scaling_type not in (None, "none"):
            raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}; supported: linear")
        architecture = GGUF_ARCHITECTURES[arch]
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=int(meta.get(f"{arch}.vocab_size", vocab_size)),
            hidden_size=hidden,
            intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
            num_hidden_layers=int(meta[f"{arch}.block_count"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=int(meta.get(f"{arch}.rope.dimension_count", hidden // num_heads)),
            rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
            tie_word_embeddings=not has_output_weight,
            attention_bias=SUPPORTED_ARCHITECTURES[architecture],
            torch_dtype=torch_dtype,
            eos_token_ids=_ids(eos),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        )


def _sliding_window(raw: dict[str, Any]) -> int | None:
    window = raw.get("sliding_window")
    if raw.get("model_type") == "qwen2" and not raw.get("use_sliding_window", False):
        return None
    if window is None or window >= raw.get("max_position_embeddings", 2048):
        return None
    return int(window)


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _rope_from_hf(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """`(rope_theta, scaling)`: transformers 5 writes `rope_parameters` (theta inside), 4 `rope_scaling`."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3" and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = raw["max_position_embeddings"]
    return theta, {"rope_type": rope_type, **params}
