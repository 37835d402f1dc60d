"""`kv_cache_dtype="fp8"`: the model over an e4m3 KV cache against itself over a float32 one, and the
engine end to end (twice the blocks of a 16-bit cache in the same bytes, four times float32's). The
kernels' fp8 paths are checked against the reference in tests/kernels (interpreter and GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagoda.kernels.kv_cache import is_token_major
from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.llm_engine import LLMEngine
from pagoda.service.engine.runner.model_runner import v_cache_token_major
from pagoda.service.model.loader import load_model
from pagoda.service.sampling_params import SamplingParams

FP8 = torch.float8_e4m3fn


def test_fp8_cache_logits_stay_close(llama_ckpt: Path, paged_runner: type) -> None:
    model, _ = load_model(llama_ckpt, dtype=torch.float32)
    prompt = list(range(100, 140))
    rows = []
    for cache_dtype in (torch.float32, FP8):
        runner = paged_runner(model, cache_dtype=cache_dtype)
        assert model.attention_layers()[0].k_cache.dtype == cache_dtype
        prefill = runner.step({0: prompt})[0]
        decode = [runner.step({0: [t]})[0] for t in (7, 300, 42)]
        rows.append(torch.cat([prefill, *decode]))
    full, fp8 = rows
    assert not torch.equal(full, fp8)  # really stored in fp8
    cosine = torch.nn.functional.cosine_similarity(full, fp8, dim=-1)
    assert cosine.mean() > 0.995 and cosine.min() > 0.98
    assert (full.argmax(-1) == fp8.argmax(-1)).float().mean() > 0.85


def test_engine_runs_over_an_fp8_cache(llama_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGODA_V_CACHE_TOKEN_MAJOR", raising=False)  # the layouts by dtype
    engines = {
        dtype: LLMEngine(
            EngineConfig(
                model=str(llama_ckpt), dtype="float32", kv_cache_dtype=dtype, kv_cache_memory_bytes=4 << 20
            )
        )
        for dtype in ("auto", "fp8")
    }
    assert engines["fp8"].runner.runner.kv_cache.dtype == FP8
    layers = {dtype: e.runner.runner.model.attention_layers()[0] for dtype, e in engines.items()}
    assert is_token_major(layers["fp8"].v_cache) and not is_token_major(layers["fp8"].k_cache)
    assert not is_token_major(layers["auto"].v_cache)  # a 16/32-bit V stays slot-major
    assert engines["fp8"].block_manager.num_blocks == 4 * engines["auto"].block_manager.num_blocks
    tokens = {}
    for dtype, engine in engines.items():
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i in range(3):  # a shared prefix: prefix-cache hits and copy-on-write read fp8 blocks too
            engine.add_request(str(i), [*range(10, 50), 60 + i], params)
        done = {}
        while engine.has_unfinished:
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        tokens[dtype] = [done[str(i)] for i in range(3)]
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # A 64-wide random model flips near ties, and greedy decoding diverges from there: compare the
    # first tokens (the closeness of the logits is the test above).
    assert all(len(t) == 12 for t in tokens["fp8"])
    assert sum(a[0] == b[0] for a, b in zip(tokens["auto"], tokens["fp8"], strict=True)) >= 2, tokens


def test_unknown_kv_cache_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")  # type: ignore[arg-type]


def test_v_cache_layout_by_dtype_and_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 V token-major, 16-bit slot-major, unless PAGODA_V_CACHE_TOKEN_MAJOR says 0 or 1."""
    monkeypatch.delenv("PAGODA_V_CACHE_TOKEN_MAJOR", raising=False)
    assert v_cache_token_major(FP8) and not v_cache_token_major(torch.bfloat16)
    monkeypatch.setenv("PAGODA_V_CACHE_TOKEN_MAJOR", "0")
    assert not v_cache_token_major(FP8)
    monkeypatch.setenv("PAGODA_V_CACHE_TOKEN_MAJOR", "1")
    assert v_cache_token_major(torch.bfloat16)
    monkeypatch.setenv("PAGODA_V_CACHE_TOKEN_MAJOR", "yes")
    with pytest.raises(ValueError, match="0 or 1"):
        v_cache_token_major(FP8)
