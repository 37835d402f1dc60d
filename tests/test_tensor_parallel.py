"""Tensor parallelism on the CPU: two ranks over gloo, this process being rank 0.

The sharding math is checked layer by layer without collectives (a group whose collectives are
left to the test); the engine at TP=2 against TP=1 and transformers, token for token in float32;
a worker killed mid-run; fp8 shards.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.runner.executor import Executor
from pagoda.service.llm import LLM
from pagoda.service.model.loader import load_model
from pagoda.service.model.parallel import TPGroup, check_tp_size
from pagoda.service.sampling_params import SamplingParams

ODD_VOCAB = 49153  # the tokenizer's 49152 plus one: the last rank holds a padding row


@pytest.fixture(scope="session")
def one_kv_head_ckpt(tmp_path_factory: pytest.TempPathFactory, tokenizer_files: Path) -> Path:
    """One KV head shared by both ranks, and a vocabulary that 2 does not divide."""
    from transformers import LlamaConfig

    from tests.conftest import _COMMON, _build

    config = LlamaConfig(
        **{**_COMMON, "vocab_size": ODD_VOCAB},
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    return _build(tmp_path_factory, "one_kv_head", tokenizer_files, config, seed=6)


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


class LocalGroup(TPGroup):
    """A rank that does not communicate: its layers return their partial results."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_shards_add_up_to_the_whole_layer(one_kv_head_ckpt: Path) -> None:
    full, config = load_model(one_kv_head_ckpt, torch.float32)
    ranks = [load_model(one_kv_head_ckpt, torch.float32, tp=LocalGroup(r, 2))[0] for r in range(2)]
    torch.manual_seed(0)
    x = torch.randn(5, config.hidden_size)
    ids = torch.tensor([0, 3, 24576, 24577, ODD_VOCAB - 1])  # both sides of the split, the last id
    with torch.inference_mode():
        embedded = sum(m.model.embed_tokens(ids) for m in ranks)
        torch.testing.assert_close(embedded, full.model.embed_tokens(ids))
        logits = torch.cat([m.lm_head(x) for m in ranks], dim=-1)
        assert logits.shape == (5, 2 * 24577) and bool((logits[:, ODD_VOCAB:] == 0).all())  # padding row
        torch.testing.assert_close(logits[:, :ODD_VOCAB], full.lm_head(x))
        mlp = sum(m.model.layers[0].mlp(x) for m in ranks)
        torch.testing.assert_close(mlp, full.model.layers[0].mlp(x))
        # q/k/v: rank r holds query heads 2r, 2r+1 and a copy of the one KV head.
        hd, full_qkv = config.head_dim, full.model.layers[1].self_attn.qkv_proj.weight
        for r, m in enumerate(ranks):
            attn = m.model.layers[1].self_attn
            assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
            q, k, v = attn.qkv_proj.weight.split([2 * hd, hd, hd])
            torch.testing.assert_close(q, full_qkv[2 * r * hd : (2 * r + 2) * hd])
            torch.testing.assert_close(torch.cat([k, v]), full_qkv[4 * hd :])
        attn_in = torch.randn(5, 4 * hd)
        o = sum(
            m.model.layers[1].self_attn.o_proj(attn_in[:, 2 * r * hd : (2 * r + 2) * hd])
            for r, m in enumerate(ranks)
        )
        torch.testing.assert_close(o, full.model.layers[1].self_attn.o_proj(attn_in))


@pytest.mark.parametrize("ckpt_name", ["qwen2_ckpt", "tied_llama_ckpt"])
def test_biased_and_tied_shards_add_up(ckpt_name: str, request: pytest.FixtureRequest) -> None:
    """Qwen2's q/k/v biases split with their rows; a tied embedding (head_dim 32, not hidden / heads)
    split once for the embedding and the LM head. Each rank's q/k/v output is its heads' columns of the
    whole layer's (biases added), the row-parallel o_proj and MLP add up, the embedding and the logits
    too. What the engine adds at TP 2 (the collectives, the worker) test_tp2_greedy_matches_tp1_and_
    transformers checks on the llama and one-KV-head checkpoints."""
    ckpt: Path = request.getfixturevalue(ckpt_name)
    full, config = load_model(ckpt, torch.float32)
    ranks = [load_model(ckpt, torch.float32, tp=LocalGroup(r, 2))[0] for r in range(2)]
    hd, nq, nkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    torch.manual_seed(0)
    x = torch.randn(5, config.hidden_size)
    ids = torch.tensor([0, 3, 24575, 24576, 49151])  # both sides of the split
    with torch.inference_mode():
        torch.testing.assert_close(
            sum(m.model.embed_tokens(ids) for m in ranks), full.model.embed_tokens(ids)
        )
        torch.testing.assert_close(torch.cat([m.lm_head(x) for m in ranks], dim=-1), full.lm_head(x))
        if config.tie_word_embeddings:
            assert all(m.lm_head.weight is m.model.embed_tokens.weight for m in ranks)
        else:
            assert full.model.layers[0].self_attn.qkv_proj.bias is not None  # Qwen2's
        for layer in range(config.num_hidden_layers):
            want_attn, want_mlp = full.model.layers[layer].self_attn, full.model.layers[layer].mlp
            q, k, v = want_attn.qkv_proj(x).split([nq * hd, nkv * hd, nkv * hd], dim=-1)
            q_cols, kv_cols = nq // 2 * hd, nkv // 2 * hd
            attn_in = torch.randn(5, nq * hd)
            for r, m in enumerate(ranks):
                want = [q[:, r * q_cols : (r + 1) * q_cols], k[:, r * kv_cols : (r + 1) * kv_cols]]
                want.append(v[:, r * kv_cols : (r + 1) * kv_cols])
                torch.testing.assert_close(m.model.layers[layer].self_attn.qkv_proj(x), torch.cat(want, -1))
            o = sum(
                m.model.layers[layer].self_attn.o_proj(attn_in[:, r * q_cols : (r + 1) * q_cols])
                for r, m in enumerate(ranks)
            )
            torch.testing.assert_close(o, want_attn.o_proj(attn_in))
            torch.testing.assert_close(sum(m.model.layers[layer].mlp(x) for m in ranks), want_mlp(x))


def test_gguf_rank_reads_its_slices(smollm2_gguf: Path) -> None:
    """SmolLM2's GGUF (9 heads, 3 KV heads, tied embeddings) as rank 1 of 3: its rows of q/k (after
    undoing llama.cpp's permutation of the whole tensor), v, gate/up, its columns of o/down."""
    full, config = load_model(smollm2_gguf, torch.float32)
    rank, _ = load_model(smollm2_gguf, torch.float32, tp=LocalGroup(1, 3))
    hd, inter = config.head_dim, config.intermediate_size // 3
    q_rows, kv_rows = slice(3 * hd, 6 * hd), slice(hd, 2 * hd)
    want, got = full.model.layers[5], rank.model.layers[5]
    q, k, v = want.self_attn.qkv_proj.weight.split([9 * hd, 3 * hd, 3 * hd])
    torch.testing.assert_close(got.self_attn.qkv_proj.weight, torch.cat([q[q_rows], k[kv_rows], v[kv_rows]]))
    torch.testing.assert_close(got.self_attn.o_proj.weight, want.self_attn.o_proj.weight[:, q_rows])
    gate, up = want.mlp.gate_up_proj.weight.split([3 * inter, 3 * inter])
    torch.testing.assert_close(
        got.mlp.gate_up_proj.weight, torch.cat([gate[inter : 2 * inter], up[inter : 2 * inter]])
    )
    torch.testing.assert_close(got.mlp.down_proj.weight, want.mlp.down_proj.weight[:, inter : 2 * inter])
    assert rank.lm_head.weight is rank.model.embed_tokens.weight
    torch.testing.assert_close(rank.lm_head.weight, full.lm_head.weight[16384:32768])


def test_unsplittable_sizes_are_refused(llama_ckpt: Path) -> None:
    _, config = load_model(llama_ckpt, torch.float32)  # 4 heads, 2 KV heads
    check_tp_size(config, 4)  # 2 KV heads over 4 ranks: replicated
    with pytest.raises(
        ValueError, match="tensor_parallel_size 3 does not divide the model's 4 attention heads"
    ):
        check_tp_size(config, 3)


def _generate(ckpt: Path, prompts: list[list[int]], params: Any, **engine: Any) -> list[Any]:
    return _generate_all(ckpt, [(prompts, params)], **engine)[0]


def _generate_all(ckpt: Path, runs: list[tuple[list[list[int]], Any]], **engine: Any) -> list[list[Any]]:
    """Each (prompts, params) run in turn on one engine."""
    llm = LLM(str(ckpt), dtype="float32", max_num_batched_tokens=32, kv_cache_memory_bytes=4 << 20, **engine)
    try:
        return [llm.generate(prompts, params) for prompts, params in runs]
    finally:
        llm.engine.runner.shutdown()


GREEDY = (random_prompts([1, 7, 17, 45]), SamplingParams(temperature=0.0, max_tokens=12))
# Chunked prefill, requests ending at different steps, greedy and seeded.
MIXED = (
    random_prompts([3, 40, 9, 70], seed=4),
    [
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=7, ignore_eos=True),
    ],
)
# Scored in chunks (the budget is 32 tokens), beside a request that only decodes.
SCORED = (
    random_prompts([70, 5], seed=9),
    [
        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=6, logprobs=2),
    ],
)


@pytest.fixture(scope="module")
def llama_tp2(llama_ckpt: Path) -> dict[str, list[Any]]:
    """The llama checkpoint's TP 2 outputs for three tests, from two engines instead of four (~6 s of
    worker start-up each): in turn, the greedy, mixed and scored runs; with async scheduling, the mixed
    one. Both engines are shut down before any test runs (one tensor-parallel engine per process). The
    runs share no prompt block, so the prefix cache serves nothing across them."""
    greedy, mixed, scored = _generate_all(llama_ckpt, [GREEDY, MIXED, SCORED], tensor_parallel_size=2)
    (pipelined,) = _generate_all(llama_ckpt, [MIXED], tensor_parallel_size=2, async_scheduling=True)
    return {"greedy": greedy, "mixed": mixed, "scored": scored, "mixed_async": pipelined}


@pytest.mark.parametrize("ckpt_name", ["llama_ckpt", "one_kv_head_ckpt"])
def test_tp2_greedy_matches_tp1_and_transformers(
    ckpt_name: str, request: pytest.FixtureRequest, hf_greedy: Any
) -> None:
    from transformers import AutoModelForCausalLM

    ckpt: Path = request.getfixturevalue(ckpt_name)
    (prompts, params), new_tokens = GREEDY, 12
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    expected = hf_greedy(model, prompts, new_tokens)
    tp1 = [o.outputs[0].token_ids for o in _generate(ckpt, prompts, params)]
    if ckpt_name == "llama_ckpt":
        outputs = request.getfixturevalue("llama_tp2")["greedy"]
    else:
        outputs = _generate(ckpt, prompts, params, tensor_parallel_size=2)
    tp2 = [o.outputs[0].token_ids for o in outputs]
    assert tp2 == tp1 == expected


def test_tp2_async_scheduling_matches_in_turn(llama_tp2: dict[str, list[Any]]) -> None:
    """Under TP with async scheduling, rank 0 broadcasts the tokens the next step's placeholders take:
    greedy and seeded outputs (chunked prefill, requests ending at different steps) are the in-turn ones."""
    in_turn, pipelined = llama_tp2["mixed"], llama_tp2["mixed_async"]
    assert [[c.token_ids for c in o.outputs] for o in pipelined] == [
        [c.token_ids for c in o.outputs] for o in in_turn
    ]


def test_tp2_prompt_logprobs_match_tp1(llama_ckpt: Path, llama_tp2: dict[str, list[Any]]) -> None:
    """Scored in chunks (the budget is 32 tokens), beside a request that only decodes."""
    one, two = _generate(llama_ckpt, *SCORED), llama_tp2["scored"]
    for a, b in zip(one, two, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    scored_one, scored_two = one[0].prompt_logprobs, two[0].prompt_logprobs
    assert scored_one is not None and scored_two is not None and len(scored_two) == 70
    for x, y in zip(scored_one[1:], scored_two[1:], strict=True):
        assert x is not None and y is not None
        assert [t.token_id for t in x.top] == [t.token_id for t in y.top]
        assert abs(x.logprob - y.logprob) < 1e-4


def _children() -> set[int]:
    """Child processes, but multiprocessing's resource tracker (one per process, started with the first
    spawned child, gone when this process exits)."""
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if "resource_tracker" not in " ".join(p.cmdline())
    }


@pytest.mark.parametrize("when", ["between_steps", "mid_run"])
def test_killed_worker_fails_the_step_and_nothing_is_left(llama_ckpt: Path, when: str) -> None:
    before = _children()
    llm = LLM(str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=4 << 20, tensor_parallel_size=2)
    executor: Executor = llm.engine.runner
    try:
        (worker_pid,) = _children() - before
        params = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
        killer = threading.Timer(1.0 if when == "mid_run" else 0.0, os.kill, (worker_pid, signal.SIGKILL))
        killer.start()
        if when == "between_steps":
            killer.join()
            while psutil.Process(worker_pid).status() != psutil.STATUS_ZOMBIE:  # not wait(): it would reap
                time.sleep(0.01)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"tensor-parallel worker rank 1 died \(exit code -9\)"):
            llm.generate([[5, 6, 7]], params)
        assert time.monotonic() - start < (1 if when == "between_steps" else 10)
        with pytest.raises(RuntimeError, match="rank 1 died"):
            executor.check_alive()
    finally:
        executor.shutdown()
    executor.shutdown()  # idempotent
    assert _children() - before == set()


def test_worker_start_up_error_comes_back(tmp_path: Path, llama_ckpt: Path) -> None:
    """o_proj of layer 0 cut to 40 of its 64 input columns: rank 0's half (0..31) loads, rank 1's
    (32..63) does not; rank 1's traceback is what rank 0 raises."""
    import shutil

    from safetensors.torch import load_file, save_file

    for item in llama_ckpt.iterdir():
        shutil.copy(item, tmp_path / item.name)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name][:, :40].contiguous()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    before = _children()
    config = EngineConfig(dtype="float32", kv_cache_memory_bytes=4 << 20, tensor_parallel_size=2)
    with pytest.raises(RuntimeError, match=r"(?s)worker rank 1 failed to start:.*o_proj.*shape \(64, 8\)"):
        Executor(config, str(tmp_path), {2})
    assert _children() - before == set()


def test_fp8_tp2_close_to_tp1(llama_ckpt: Path) -> None:
    """Each rank quantizes its own shard, and the row-parallel layers quantize a shard of each token's
    activations: the logits move, but less than fp8 itself moves them from float32."""
    from pagoda.service.model.fp8 import Fp8Linear

    prompt = random_prompts([40], seed=4)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)

    def scores(**engine: Any) -> torch.Tensor:
        (out,) = _generate(llama_ckpt, prompt, params, **engine)
        assert out.prompt_logprobs is not None
        return torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:] if lp is not None])

    exact, fp8 = scores(), scores(quantization="fp8")
    llm = LLM(
        str(llama_ckpt),
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        quantization="fp8",
        tensor_parallel_size=2,
    )
    try:
        o_proj = llm.engine.runner.model.model.layers[0].self_attn.o_proj
        assert isinstance(o_proj, Fp8Linear) and o_proj.reduce is not None and o_proj.weight.shape == (64, 32)
        (out,) = llm.generate(prompt, params)
    finally:
        llm.engine.runner.shutdown()
    assert out.prompt_logprobs is not None
    fp8_tp2 = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:] if lp is not None])
    assert (fp8_tp2 - fp8).abs().mean() < (fp8 - exact).abs().mean()
    assert (fp8_tp2 - fp8).abs().mean() < 0.05


def test_refused_before_any_process_starts(monkeypatch: pytest.MonkeyPatch, llama_ckpt: Path) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from pagoda.service.engine.runner import executor as executor_module

    config = EngineConfig(device="cuda", tensor_parallel_size=2)
    monkeypatch.setattr(executor_module, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 needs 2 GPUs .*this machine has 1"):
        Executor(config, str(llama_ckpt), {2})
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=5))
    try:
        with pytest.raises(RuntimeError, match="one tensor-parallel engine per process"):
            Executor(EngineConfig(tensor_parallel_size=2), str(llama_ckpt), {2})
    finally:
        dist.destroy_process_group()
