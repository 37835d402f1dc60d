"""Pipeline parallelism on the CPU: stages over gloo, this process being rank 0.

The layer split and the micro-batches as pure functions; each stage's model in this process, composed
by hand, against the whole model; then engines of 2 and 3 stages (and 2 stages x 2 tensor-parallel
ranks) against transformers token for token in float32, with chunked prefill so that steps split into
micro-batches, prompt log-probabilities, n = 2, the prefix cache, fp8, a killed stage, and `pagoda
serve --pipeline-parallel-size 2` stopped by SIGTERM. Each engine serves several assertions: four gloo
processes on two cores start in ~13 s.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from process_group import children, group_members, wait_for

from pagoda.service.cli import build_configs
from pagoda.service.engine.config import EngineConfig, LoRAConfig, SpeculativeConfig
from pagoda.service.engine.runner import model_runner
from pagoda.service.engine.runner.pipeline import split_micro_batches
from pagoda.service.llm import LLM
from pagoda.service.model.attention import AttentionMetadata
from pagoda.service.model.fp8 import quantize_model_fp8
from pagoda.service.model.loader import load_model
from pagoda.service.model.pipeline import PPGroup, log_split, split_layers
from pagoda.service.sampling_params import SamplingParams
from pagoda.service.serve_process import ServeProcess

NEW_TOKENS = 10
# A 32-token step budget: the 45- and 70-token prompts prefill in chunks beside the others' decodes.
ENGINE = {"dtype": "float32", "max_num_batched_tokens": 32, "kv_cache_memory_bytes": 4 << 20}
LENGTHS = [1, 7, 17, 45, 70]


@pytest.fixture(scope="session")
def llama3_ckpt(tmp_path_factory: pytest.TempPathFactory, tokenizer_files: Path) -> Path:
    """Three layers: two stages split them 2 + 1, three stages 1 + 1 + 1."""
    from transformers import LlamaConfig

    from tests.conftest import _COMMON, _build

    config = LlamaConfig(
        **_COMMON,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    return _build(tmp_path_factory, "llama_3_layers", tokenizer_files, config, seed=11)


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


def hf_prompt_logprobs(model: Any, prompt: list[int]) -> list[float]:
    """transformers' log-probability of each prompt token after the first."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()


def engine_prompt_logprobs(out: Any) -> list[float]:
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    return [lp.logprob for lp in out.prompt_logprobs[1:]]


def tokens(outputs: list[Any]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


# ---- the split and the micro-batches ---------------------------------------------------------------


def test_split_layers_evenly_and_the_rest_before_the_last_stage(caplog: pytest.LogCaptureFixture) -> None:
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert split_layers(7, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    assert split_layers(6, 4) == [range(0, 1), range(1, 3), range(3, 5), range(5, 6)]
    assert split_layers(32, 4) == [range(0, 8), range(8, 16), range(16, 24), range(24, 32)]
    assert split_layers(3, 1) == [range(0, 3)]
    with pytest.raises(
        ValueError, match="pipeline_parallel_size 4 is more than the model's 3 decoder layers"
    ):
        split_layers(3, 4)
    with caplog.at_level(logging.INFO, logger="pagoda.service.model.pipeline"):
        log_split(split_layers(5, 2))
    assert caplog.messages == [
        "pipeline stage 0: layers 0..2 (3 of 5)",
        "pipeline stage 1: layers 3..4 (2 of 5)",
    ]


def test_micro_batches_cut_whole_requests_near_equal_token_shares() -> None:
    counts = np.array([5, 1, 1, 20, 3])  # 30 tokens; half is 15: the nearest request boundary is 7
    starts = np.concatenate([[0], np.cumsum(counts)])
    batch = {
        "input_ids": np.arange(30) + 100,
        "positions": np.arange(30) + 200,
        "slot_mapping": np.arange(30) + 300,
        "block_tables": np.arange(10, dtype=np.int32).reshape(5, 2),
        "seq_lens": counts + 8,
        "query_start_loc": starts,
        "max_query_len": counts.max(),
    }
    sampled = [0, 1, 3, 4]  # request 2 is a prompt chunk short of its end
    logit_rows = starts[1:][sampled] - 1
    prompt_chunks = [(3, 7, 19)]  # request 3 scores 19 of its rows for prompt log-probabilities
    first, second = split_micro_batches(batch, logit_rows, prompt_chunks, 2)
    assert (first.tokens, second.tokens) == (slice(0, 7), slice(7, 30))
    assert first.batch["query_start_loc"].tolist() == [0, 5, 6, 7]
    assert second.batch["query_start_loc"].tolist() == [0, 20, 23]
    assert second.batch["input_ids"].tolist() == list(range(107, 130))
    assert second.batch["slot_mapping"][0] == 307 and second.batch["positions"][-1] == 229
    assert second.batch["block_tables"].tolist() == [[6, 7], [8, 9]]
    assert second.batch["seq_lens"].tolist() == [28, 11]
    assert (first.batch["max_query_len"], second.batch["max_query_len"]) == (5, 20)
    assert (first.logit_rows.tolist(), second.logit_rows.tolist()) == ([4, 5], [19, 22])
    assert (first.prompt_chunks, second.prompt_chunks) == ([], [(0, 19)])
    assert (first.num_logit_rows, second.num_logit_rows) == (2, 21)
    # The rows concatenated in order are the step's: rank 0 concatenates the logits the same way.
    rows = np.concatenate([mb.logit_rows + mb.tokens.start for mb in (first, second)])
    assert rows.tolist() == logit_rows.tolist()
    # Never more micro-batches than requests; one request is one micro-batch.
    assert len(split_micro_batches(batch, logit_rows, prompt_chunks, 8)) == 5
    (alone,) = split_micro_batches(
        {**batch, "query_start_loc": np.array([0, 30]), "block_tables": batch["block_tables"][:1],
         "seq_lens": np.array([30])},
        np.array([29]), [], 4,
    )  # fmt: skip
    assert alone.tokens == slice(0, 30) and alone.logit_rows.tolist() == [29]


def _prefill(model: Any, prompt: list[int], num_blocks: int = 8) -> AttentionMetadata:
    """Bind a fresh KV cache to `model`'s layers; the layout of `prompt` as one prefill."""
    for attn in model.attention_layers():
        attn.k_cache = torch.zeros(num_blocks, 16, attn.num_kv_heads, attn.head_dim)
        attn.v_cache = torch.zeros(num_blocks, 16, attn.num_kv_heads, attn.head_dim)
    n = len(prompt)
    return AttentionMetadata(
        slot_mapping=torch.arange(n),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        max_query_len=n,
        max_seq_len=n,
        decode_rows=n == 1,
    )


@pytest.mark.parametrize("ckpt_name", ["llama3_ckpt", "tied_llama_ckpt", "qwen2_ckpt"])
def test_stages_hold_their_layers_and_compose_to_the_whole_model(
    ckpt_name: str, request: pytest.FixtureRequest
) -> None:
    """Two stages built in this process: each holds only its layers' parameters (global names), stage 0
    the embedding, the last stage the norm and an LM head (its own copy of a tied embedding); run in
    turn, hidden state and residual handed over, they give the whole model's logits. Under fp8 the
    last projection before the boundary hands over a plain tensor. Qwen2: each stage loads its layers'
    q/k/v biases (what its engine test at PP 2 did beyond llama3's; the worker loads a stage alike)."""
    ckpt: Path = request.getfixturevalue(ckpt_name)
    full, config = load_model(ckpt, torch.float32)
    stages = [load_model(ckpt, torch.float32, pp=PPGroup(s, 2))[0] for s in range(2)]
    split = split_layers(config.num_hidden_layers, 2)
    for stage, (model, layers) in enumerate(zip(stages, split, strict=True)):
        names = {name for name, _ in model.named_parameters()}
        held = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
        assert held == set(layers) and len(model.attention_layers()) == len(layers)
        assert ("model.embed_tokens.weight" in names) == (stage == 0)
        assert ("model.norm.weight" in names) == ("lm_head.weight" in names) == (stage == 1)
    if config.tie_word_embeddings:
        assert full.lm_head.weight is full.model.embed_tokens.weight  # type: ignore[union-attr]
        torch.testing.assert_close(stages[1].lm_head.weight, full.lm_head.weight)  # type: ignore[union-attr]
    prompt = random_prompts([23], seed=5)[0]
    ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
    with torch.inference_mode():
        want = full.compute_logits(full(ids, positions, _prefill(full, prompt)))
        meta = [_prefill(model, prompt) for model in stages]
        hidden, residual = stages[0].run_layers(positions, stages[0].embed(ids), None, meta[0])
        assert isinstance(hidden, torch.Tensor)
        hidden, residual = stages[1].run_layers(positions, hidden, residual, meta[1])
        got = stages[1].compute_logits(stages[1].final_norm(hidden, residual))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert quantize_model_fp8(stages[0], torch.device("cpu")) == 4 * len(split[0])
    assert [layer.mlp.defer_down_scales for layer in stages[0].decoder_layers()] == [True] * (
        len(split[0]) - 1
    ) + [False]
    quantize_model_fp8(stages[1], torch.device("cpu"))
    assert stages[1].decoder_layers()[-1].mlp.defer_down_scales  # the final norm applies its scales


# ---- engines ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_llama3(llama3_ckpt: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama3_ckpt, dtype=torch.float32).eval()


def test_pp2_matches_transformers_in_micro_batches_with_logprobs_forks_and_the_prefix_cache(
    llama3_ckpt: Path,
    hf_llama3: Any,
    hf_greedy: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two stages (layers 0..1 and 2), async scheduling on: prompts of 1 to 70 tokens in a 32-token
    budget (chunked prefill beside decodes, so steps split into two micro-batches), a request scoring its
    prompt, and n = 2 seeded sampling; then the same prompts again, served from the prefix cache. Each
    stage's KV cache holds its own layers: 4 MiB is 512 blocks of stage 0's two, 1024 of stage 1's one."""
    splits: list[int] = []
    split = model_runner.split_micro_batches

    def counting(*args: Any) -> Any:
        micro = split(*args)
        splits.append(len(micro))
        return micro

    monkeypatch.setattr(model_runner, "split_micro_batches", counting)  # rank 0's
    prompts = random_prompts(LENGTHS)
    expected = hf_greedy(hf_llama3, prompts, NEW_TOKENS)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    scored = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    forked = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=6, ignore_eos=True)
    batch, params = [*prompts, prompts[4], prompts[2]], [greedy] * len(prompts) + [scored, forked]
    with caplog.at_level(logging.INFO, logger="pagoda.service.engine.runner.executor"):
        llm = LLM(str(llama3_ckpt), pipeline_parallel_size=2, async_scheduling=True, **ENGINE)
    with llm:
        got = llm.generate(batch, params)
        again = llm.generate(prompts, greedy)
    with LLM(str(llama3_ckpt), **ENGINE) as one:
        ref = one.generate(batch, params)
    assert "KV blocks per rank [512, 1024]: all use 512" in caplog.messages
    assert llm.engine.runner.kv.bytes_per_block * 3 == one.engine.runner.kv.bytes_per_block * 2
    assert [t[0] for t in tokens(got[: len(prompts)])] == expected
    assert tokens(got) == tokens(ref)  # the scored request and both seeded forks too
    scores, want = engine_prompt_logprobs(got[5]), hf_prompt_logprobs(hf_llama3, prompts[4])
    assert len(scores) == 69 and max(abs(a - b) for a, b in zip(scores, want, strict=True)) < 1e-4
    assert (
        [[t.token_id for t in lp.top] for lp in got[5].prompt_logprobs[1:]]
        == [  # type: ignore[union-attr]
            [t.token_id for t in lp.top]
            for lp in ref[5].prompt_logprobs[1:]  # type: ignore[union-attr]
        ]
    )
    assert 2 in splits and max(splits) == 2
    assert [t[0] for t in tokens(again)] == expected
    assert again[4].metrics.num_cached_tokens == 64  # the 70-token prompt's four full blocks


def test_pp2_tp2_matches_transformers(llama3_ckpt: Path, hf_llama3: Any, hf_greedy: Any) -> None:
    """Four ranks: two stages of two tensor-parallel ranks each; prompt log-probabilities beside."""
    prompts = random_prompts(LENGTHS, seed=1)
    expected = hf_greedy(hf_llama3, prompts, NEW_TOKENS)
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS)] * len(prompts)
    params[3] = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, prompt_logprobs=1)
    with LLM(str(llama3_ckpt), pipeline_parallel_size=2, tensor_parallel_size=2, **ENGINE) as llm:
        got = llm.generate(prompts, params)
    assert [t[0] for t in tokens(got)] == expected
    scores, want = engine_prompt_logprobs(got[3]), hf_prompt_logprobs(hf_llama3, prompts[3])
    assert max(abs(a - b) for a, b in zip(scores, want, strict=True)) < 1e-4


def test_pp2_tied_matches_transformers(tied_llama_ckpt: Path, hf_greedy: Any) -> None:
    """Tied embeddings (the last stage's own LM head) with prompt-lookup speculation, whose verified
    rows cross the micro-batches. (Qwen2's q/k/v biases per stage: the in-process composition test.)"""
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(LENGTHS, seed=2)
    model = AutoModelForCausalLM.from_pretrained(tied_llama_ckpt, dtype=torch.float32).eval()
    expected = hf_greedy(model, prompts, 16)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": False}
    with LLM(str(tied_llama_ckpt), pipeline_parallel_size=2, **ENGINE, speculative_config=spec) as llm:
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
        speculator = llm.engine.core.speculator
    assert [t[0] for t in tokens(got)] == expected
    assert speculator is not None and speculator.stats.num_draft_tokens > 0  # verified across the stages


def test_pp3_fp8_with_an_fp8_kv_cache_matches_one_stage(llama3_ckpt: Path) -> None:
    """Three stages of one layer each (a middle stage receives and sends): fp8 projections and an fp8 KV
    cache give the one-stage engine's tokens and prompt log-probabilities."""
    prompts = random_prompts(LENGTHS, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS)] * len(prompts)
    params[4] = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0)
    fp8 = {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    with LLM(str(llama3_ckpt), **ENGINE, **fp8) as one:
        want = one.generate(prompts, params)
    with LLM(str(llama3_ckpt), pipeline_parallel_size=3, **ENGINE, **fp8) as llm:
        got = llm.generate(prompts, params)
    assert tokens(got) == tokens(want)
    scores, ref = engine_prompt_logprobs(got[4]), engine_prompt_logprobs(want[4])
    assert max(abs(a - b) for a, b in zip(scores, ref, strict=True)) < 1e-4


# ---- death, shutdown, refusals ---------------------------------------------------------------------


def _children() -> set[int]:
    """Child processes, but multiprocessing's resource tracker."""
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if "resource_tracker" not in " ".join(p.cmdline())
    }


def test_a_killed_stage_fails_the_engine_and_nothing_is_left(llama3_ckpt: Path) -> None:
    before = _children()
    llm = LLM(str(llama3_ckpt), pipeline_parallel_size=2, **ENGINE)
    try:
        (last_stage,) = _children() - before
        killer = threading.Timer(1.0, os.kill, (last_stage, signal.SIGKILL))
        killer.start()
        params = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
        with pytest.raises(
            RuntimeError, match=r"worker rank 1 \(pipeline stage 1, .*\) died \(exit code -9\)"
        ):
            llm.generate([[5, 6, 7], [8, 9]], params)
        with pytest.raises(RuntimeError, match=r"rank 1 .* died"):
            llm.engine.runner.check_alive()
    finally:
        llm.shutdown()
    assert _children() - before == set()


def test_serve_pp2_answers_and_sigterm_leaves_no_process(llama3_ckpt: Path, tmp_path: Path) -> None:
    args = ["--model", str(llama3_ckpt), "--device", "cpu", "--kv-cache-memory-bytes", str(4 << 20)]
    args += ["--pipeline-parallel-size", "2"]
    server = ServeProcess(args, log_path=tmp_path / "serve.log", new_session=True).start()
    assert server.proc is not None
    pgid = server.proc.pid
    try:
        assert len(children(pgid)) >= 2, "the engine core and the stage-1 worker"
        request = urllib.request.Request(
            f"{server.base_url}/v1/completions",
            data=json.dumps({"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] == 4
        log = server.log()
        assert "pipeline stage 0: layers 0..1 (2 of 3)" in log and "pipeline stage 1: layers 2..2" in log
        os.killpg(pgid, signal.SIGTERM)  # the worker and the core relay it: the server drains and stops
        assert server.wait() == 0, server.log()[-3000:]
    finally:
        if server.proc.poll() is None:
            server.kill()
    assert wait_for(lambda: not group_members(pgid), 10), group_members(pgid)


def test_refused_under_pipeline_parallelism(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="speculative decoding with a draft model is not supported"):
        EngineConfig(
            pipeline_parallel_size=2, speculative=SpeculativeConfig("draft_model", model=str(tmp_path))
        )
    with pytest.raises(ValueError, match=r"LoRA adapters \(--enable-lora\) are not supported under pipeline"):
        EngineConfig(pipeline_parallel_size=2, lora=LoRAConfig())
    with pytest.raises(ValueError, match="pipeline_parallel_size must be at least 1, got 0"):
        EngineConfig(pipeline_parallel_size=0)
    EngineConfig(pipeline_parallel_size=2, speculative=SpeculativeConfig())  # prompt lookup runs


def test_the_flag() -> None:
    from pagoda.cli import build_parser

    def parse(*argv: str) -> Any:
        return build_parser().parse_args(["serve", *argv])

    _, engine = build_configs(parse("--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"))
    assert (engine.pipeline_parallel_size, engine.tensor_parallel_size) == (2, 2)
    assert build_configs(parse())[1].pipeline_parallel_size == 1
    with pytest.raises(ValueError, match="--pipeline-parallel-size must be at least 1, got 0"):
        build_configs(parse("--pipeline-parallel-size", "0"))
    with pytest.raises(ValueError, match="LoRA adapters"):
        build_configs(parse("--pipeline-parallel-size", "2", "--enable-lora"))
    help_text = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--pipeline-parallel-size" in help_text and "PAGODA_PIPELINE_PARALLEL_SIZE" in help_text
