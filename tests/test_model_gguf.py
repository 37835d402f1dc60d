"""The embedded SmolLM2 GGUF: our dequantized weights and logits against transformers on the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagoda.service.model import load_tokenizer
from pagoda.service.model.loader import load_model

pytestmark = pytest.mark.slow  # two loads of a 135M-parameter model: ~30 s on 2 CPU cores


@pytest.fixture(scope="module")
def ours(smollm2_gguf: Path):
    return load_model(smollm2_gguf, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def theirs(smollm2_transformers: Path):
    """transformers' reading of the same GGUF (conftest.py saves it once per run)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_transformers, dtype=torch.float32).eval()


def test_config_from_gguf_metadata(ours) -> None:
    _, config = ours
    assert config.architecture == "LlamaForCausalLM"
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (576, 30, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.tie_word_embeddings  # the file has no output.weight
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1


def test_weights_equal_transformers(ours, theirs) -> None:
    """Same dequantization and the same inverse of llama.cpp's q/k permutation, bit for bit."""
    model, config = ours
    hf = theirs.state_dict()
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    for i in (0, config.num_hidden_layers - 1):
        qkv = model.model.layers[i].self_attn.qkv_proj.weight
        q, k, v = qkv.split([q_size, kv_size, kv_size])
        assert torch.equal(q, hf[f"model.layers.{i}.self_attn.q_proj.weight"])
        assert torch.equal(k, hf[f"model.layers.{i}.self_attn.k_proj.weight"])
        assert torch.equal(v, hf[f"model.layers.{i}.self_attn.v_proj.weight"])
        gate, up = model.model.layers[i].mlp.gate_up_proj.weight.chunk(2)
        assert torch.equal(gate, hf[f"model.layers.{i}.mlp.gate_proj.weight"])
        assert torch.equal(up, hf[f"model.layers.{i}.mlp.up_proj.weight"])
    assert torch.equal(model.model.embed_tokens.weight, hf["model.embed_tokens.weight"])
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_logits_match_transformers(ours, theirs, smollm2_gguf: Path, paged_runner) -> None:
    model, _ = ours
    tokenizer = load_tokenizer(smollm2_gguf)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    prompt_ids = tokenizer.encode(prompt)
    runner = paged_runner(model, num_blocks=32)
    (prefill,) = runner.step({0: prompt_ids})
    generated = [int(prefill[-1].argmax())]
    rows = [prefill]
    for _ in range(3):
        (decode,) = runner.step({0: generated[-1:]})
        rows.append(decode)
        generated.append(int(decode[-1].argmax()))
    with torch.inference_mode():
        expected = theirs(torch.tensor([prompt_ids + generated[:-1]])).logits[0]
    got = torch.cat(rows)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert tokenizer.decode(generated).startswith("The capital")
