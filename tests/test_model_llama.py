"""Our Llama-family forward pass over a paged KV cache equals transformers' logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagoda.service.model.loader import load_model


def hf_logits(folder: Path, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()


PROMPT_A = [1, 504, 3458, 282, 4649, 314, 17535, 30, 378, 3821, 5284, 281, 260, 7265, 28]  # 15 tokens
PROMPT_B = [9906, 1345, 28, 216, 33, 34, 35]  # 7 tokens
CKPTS = ["llama_ckpt", "qwen2_ckpt", "tied_llama_ckpt", "sharded_llama_ckpt", "mistral_ckpt"]


@pytest.mark.parametrize("ckpt", CKPTS)
def test_prefill_and_decode_match_transformers(
    ckpt: str, request: pytest.FixtureRequest, paged_runner
) -> None:
    folder = request.getfixturevalue(ckpt)
    model, _ = load_model(folder, dtype=torch.float32, device="cpu")
    runner = paged_runner(model)
    full = [*PROMPT_A, 42, 4242]
    expected = hf_logits(folder, full)

    (prefill,) = runner.step({0: PROMPT_A})
    torch.testing.assert_close(prefill, expected[: len(PROMPT_A)], atol=1e-4, rtol=1e-4)
    for i, token in enumerate(full[len(PROMPT_A) :]):
        (decode,) = runner.step({0: [token]})
        torch.testing.assert_close(decode[0], expected[len(PROMPT_A) + i], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ckpt", ["llama_ckpt", "qwen2_ckpt"])
def test_mixed_batch_with_chunked_prefill(ckpt: str, request: pytest.FixtureRequest, paged_runner) -> None:
    """One flattened batch holds a prefill chunk, a full prefill and later decodes, each correct."""
    folder = request.getfixturevalue(ckpt)
    model, _ = load_model(folder, dtype=torch.float32)
    runner = paged_runner(model)
    expected_a = hf_logits(folder, [*PROMPT_A, 7])
    expected_b = hf_logits(folder, [*PROMPT_B, 8, 9])

    a1, b1 = runner.step({0: PROMPT_A[:6], 1: PROMPT_B})
    a2, b2 = runner.step({0: PROMPT_A[6:], 1: [8]})
    a3, b3 = runner.step({0: [7], 1: [9]})
    got_a = torch.cat([a1, a2, a3])
    got_b = torch.cat([b1, b2, b3])
    torch.testing.assert_close(got_a, expected_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_b, expected_b, atol=1e-4, rtol=1e-4)


def test_config_fields(llama_ckpt: Path, qwen2_ckpt: Path, tied_llama_ckpt: Path) -> None:
    from pagoda.service.model.config import ModelConfig

    llama = ModelConfig.from_folder(llama_ckpt)
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim) == (4, 2, 16)
    assert llama.rope_scaling is not None and llama.rope_scaling["rope_type"] == "llama3"
    assert llama.rope_theta == 500000.0
    assert llama.eos_token_ids == (2,) and llama.bos_token_id == 1
    assert llama.torch_dtype == torch.float32 and not llama.attention_bias
    assert ModelConfig.from_folder(qwen2_ckpt).attention_bias
    tied = ModelConfig.from_folder(tied_llama_ckpt)
    assert tied.tie_word_embeddings and tied.head_dim == 32 and tied.rope_scaling is None


def test_tied_model_shares_embedding(tied_llama_ckpt: Path) -> None:
    model, config = load_model(tied_llama_ckpt, dtype=torch.float32)
    assert config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(p.is_meta for p in model.parameters())
    assert len(model.attention_layers()) == config.num_hidden_layers


def test_rope_cache_matches_transformers(llama_ckpt: Path, sharded_llama_ckpt: Path) -> None:
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pagoda.service.model.config import ModelConfig
    from pagoda.service.model.llama import rope_inv_freq

    for folder, rope_type in ((llama_ckpt, "llama3"), (sharded_llama_ckpt, "linear")):
        hf_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](AutoConfig.from_pretrained(folder), "cpu")
        assert torch.equal(rope_inv_freq(ModelConfig.from_folder(folder)), hf_inv_freq)


def test_auto_dtype_is_checkpoint_dtype(llama_ckpt: Path) -> None:
    model, config = load_model(llama_ckpt, dtype="auto")
    assert model.model.embed_tokens.weight.dtype == config.torch_dtype == torch.float32
    model, _ = load_model(llama_ckpt, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
