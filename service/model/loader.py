"""Weights from a Hugging Face checkpoint folder or a GGUF file into `LlamaForCausalLM`.

Both sources are reduced to one question, "the tensor Hugging Face calls NAME (or the slice of it
this tensor-parallel rank holds), or None", and one assembly step maps our parameters to those
names, concatenating q/k/v and gate/up. The model is built on the meta device, so no memory is
spent on random initial weights, and a rank reads only its slices: safetensors slices straight from
the file, GGUF one dequantized tensor at a time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from pagoda.service.model.config import ModelConfig
from pagoda.service.model.llama import LlamaForCausalLM
from pagoda.service.model.parallel import SINGLE_RANK, Shard, TPGroup
from pagoda.service.model.pipeline import SINGLE_STAGE, PPGroup

logger = logging.getLogger(__name__)

DType = torch.dtype | Literal["auto"]
TensorSource = Callable[[str, Shard | None], torch.Tensor | None]

# Our merged parameters -> the Hugging Face tensors concatenated (dim 0) to make them.
_MERGED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def load_model(
    path: str | Path,
    dtype: DType = "auto",
    device: str | torch.device = "cpu",
    tp: TPGroup = SINGLE_RANK,
    pp: PPGroup = SINGLE_STAGE,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """`(model, config)` from a checkpoint folder or a `.gguf` file; under `tp`, this rank's shard, and
    under `pp`, this stage's layers."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"a model file must be a .gguf file, got {path}")
        return load_gguf(path, dtype, device, tp, pp)
    return load_hf_folder(path, dtype, device, tp, pp)


def load_hf_folder(
    folder: Path,
    dtype: DType = "auto",
    device: str | torch.device = "cpu",
    tp: TPGroup = SINGLE_RANK,
    pp: PPGroup = SINGLE_STAGE,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    from safetensors import safe_open

    config = ModelConfig.from_folder(folder)
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    else:
        single = folder / "model.safetensors"
        if not single.is_file():
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {folder}")
        with safe_open(single, framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), single.name)
    for file_name in sorted(set(weight_map.values())):
        if not (folder / file_name).is_file():
            raise FileNotFoundError(f"checkpoint shard not found: {folder / file_name}")
    if "lm_head.weight" not in weight_map:
        config = dataclasses.replace(config, tie_word_embeddings=True)

    with ExitStack() as stack:
        handles = {
            name: stack.enter_context(safe_open(folder / name, framework="pt"))
            for name in sorted(set(weight_map.values()))
        }

        def get(name: str, shard: Shard | None) -> torch.Tensor | None:
            file_name = weight_map.get(name)
            if file_name is None:
                return None
            if shard is None:
                return handles[file_name].get_tensor(name)
            view = handles[file_name].get_slice(name)
            return view[shard.start : shard.stop] if shard.dim == 0 else view[:, shard.start : shard.stop]

        model = build_model(config, get, _resolve_dtype(dtype, config), device, str(folder), tp, pp)
    return model, config


def load_gguf(
    path: Path,
    dtype: DType = "auto",
    device: str | torch.device = "cpu",
    tp: TPGroup = SINGLE_RANK,
    pp: PPGroup = SINGLE_STAGE,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Dequantize each tensor on load, one at a time; undo llama.cpp's q/k row permutation as
    transformers does (per head, so before a rank takes its heads)."""
    import gguf

    from pagoda.service.model.gguf_file import read_gguf

    file = read_gguf(path)
    meta, tensors = file.metadata, file.tensors
    file_type = meta.get("general.file_type")
    # "auto" keeps a float16/bfloat16 file's dtype; quantized weights dequantize exactly to float32.
    checkpoint_dtype = {1: torch.float16, 32: torch.bfloat16}.get(int(file_type or 0), torch.float32)
    vocab_size = len(meta["tokenizer.ggml.tokens"])
    config = ModelConfig.from_gguf_metadata(meta, vocab_size, "output.weight" in tensors, checkpoint_dtype)
    arch = meta["general.architecture"]
    hf_to_gguf = {_gguf_to_hf(name): name for name in tensors}

    def get(name: str, shard: Shard | None) -> torch.Tensor | None:
        gguf_name = hf_to_gguf.get(name)
        if gguf_name is None:
            return None
        tensor = tensors[gguf_name]
        array = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType(tensor.tensor_type))
        weights = torch.from_numpy(array.copy()).view(*reversed([int(n) for n in tensor.shape]))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            weights = _reverse_permute(weights, heads)
        if shard is None:
            return weights
        stop = min(shard.stop, weights.shape[shard.dim])  # short of the shard: the shape check says so
        return weights.narrow(shard.dim, shard.start, stop - shard.start).clone()  # frees the rest

    model = build_model(config, get, _resolve_dtype(dtype, config), device, str(path), tp, pp)
    return model, config


def build_model(
    config: ModelConfig,
    get: TensorSource,
    dtype: torch.dtype,
    device: str | torch.device,
    source: str,
    tp: TPGroup = SINGLE_RANK,
    pp: PPGroup = SINGLE_STAGE,
) -> LlamaForCausalLM:
    """The model's parameters (this stage's: the others' layers have none) from `get`."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp, pp)
    model.cos_sin_cache = model.cos_sin_cache.to(device)
    has_embedding = model.model.embed_tokens is not None
    for name, _ in list(model.named_parameters()):
        checkpoint_name = name
        if name == "lm_head.weight" and config.tie_word_embeddings:
            if has_embedding:
                continue  # the embedding's own tensor, tied below
            checkpoint_name = "model.embed_tokens.weight"  # a last stage without it: its own copy
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        shards: tuple[Shard, ...] | None = getattr(owner, "param_shards", {}).get(attr)
        weight = _assemble(checkpoint_name, get, shards, source)
        expected = tuple(getattr(owner, attr).shape)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"{source}: tensor for {name} has shape {tuple(weight.shape)}, expected {expected}"
            )
        setattr(owner, attr, nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False))
    if config.tie_word_embeddings and has_embedding and model.lm_head is not None:
        model.lm_head.weight = model.model.embed_tokens.weight  # type: ignore[union-attr]
    layers = model.local_layers
    logger.info(
        "loaded %s: %d layers, hidden %d, %s on %s%s%s",
        source,
        config.num_hidden_layers,
        config.hidden_size,
        dtype,
        device,
        f", tensor-parallel rank {tp.rank} of {tp.size}" if tp.size > 1 else "",
        f", pipeline stage {pp.stage} of {pp.size} (layers {layers.start}..{layers.stop - 1})"
        if pp.size > 1
        else "",
    )
    return model.eval()


def _assemble(name: str, get: TensorSource, shards: tuple[Shard, ...] | None, source: str) -> torch.Tensor:
    prefix, _, suffix = name.rpartition(".")  # suffix: weight / bias
    for merged, parts in _MERGED.items():
        if prefix.endswith(merged):
            base = prefix[: -len(merged)]
            names = [f"{base}{part}.{suffix}" for part in parts]
            break
    else:
        names = [name]
    tensors = []
    for tensor_name, shard in zip(names, shards or [None] * len(names), strict=True):
        tensor = get(tensor_name, shard)
        if tensor is None:
            raise ValueError(f"{source}: checkpoint has no tensor {tensor_name!r}")
        if shard is not None and shard.limit is not None and tensor.shape[shard.dim] < shard.size:
            missing = list(tensor.shape)  # the vocabulary's padding rows
            missing[shard.dim] = shard.size - tensor.shape[shard.dim]
            tensor = torch.cat([tensor, tensor.new_zeros(missing)], dim=shard.dim)
        tensors.append(tensor)
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def _resolve_dtype(dtype: DType, config: ModelConfig) -> torch.dtype:
    if dtype == "auto":
        return config.torch_dtype
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype or 'auto', got {dtype!r}")
    return dtype


_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _gguf_to_hf(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; unknown names pass through."""
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if match and match.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}.{match.group(3)}"
    base, _, suffix = name.rpartition(".")
    return f"{_GGUF_GLOBAL_NAMES[base]}.{suffix}" if base in _GGUF_GLOBAL_NAMES else name


def _reverse_permute(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` (interleaved rope halves -> rotate-half), as transformers does."""
    dim = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, dim, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)
