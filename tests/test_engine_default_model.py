"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF): the engine against transformers
loading the same file, and the answer `make demo` shows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagoda.service.llm import LLM
from pagoda.service.sampling_params import SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_num_batched_tokens=256)


def test_answers_paris(llm: LLM) -> None:
    out = llm.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"


def test_greedy_matches_transformers_on_the_same_gguf(
    llm: LLM, smollm2_transformers: Path, hf_greedy: Any
) -> None:
    from transformers import AutoModelForCausalLM

    # transformers' reading of the embedded GGUF, saved once per run by conftest.py
    hf = AutoModelForCausalLM.from_pretrained(smollm2_transformers, dtype=torch.float32).eval()
    tok = llm.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template(QUESTION), add_special_tokens=False),
        tok.encode("Once upon a time, in a small village by the sea,"),
        tok.encode("def fibonacci(n):"),
    ]
    new_tokens = 32
    # Both stop at the end-of-sequence token (and keep it): transformers' min_new_tokens would
    # instead suppress it, which ignore_eos does not.
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert ours == hf_greedy(hf, prompts, new_tokens)
