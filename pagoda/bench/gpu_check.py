"""The engine on a CUDA GPU against Hugging Face transformers, on random-weight checkpoints built here.

Run on a GPU machine (no network needed): `python -m pagoda.bench.gpu_check --tokenizer DIR`, where
DIR holds a `tokenizer.json` + `tokenizer_config.json` (any byte-level BPE works: the checks feed
token ids). The checks, each printed as a row of a pass/fail table:

1. float32, greedy: the engine (Triton kernels, decode CUDA graphs, a mixed batch) generates the same
   tokens as transformers `generate()` (TF32 off on both sides).
2. CUDA graphs vs eager: the same greedy tokens with `enforce_eager=True`. Async scheduling (on by
   default with one GPU) vs steps in turn: the same greedy and seeded-sampling tokens.
3. bfloat16, teacher-forced: fp32 transformers scores the engine's own bf16 greedy continuation. The
   engine's tokens must equal fp32's top-1 on at least 99% of steps, or (random models have many
   near-ties that bf16 rounding alone flips) at least as often as bf16 transformers' own top-1 does,
   less 2 points; the engine's log-probabilities must stay within 1.5x transformers-bf16's worst
   distance from fp32, plus 0.05 nats.
4. The same with fp8 (W8A8) projections, and with an fp8 KV cache (whose graphs must equal eager),
   reported as INFO, not judged: fp8 keeps 3 mantissa bits,
   and on random-weight models, whose top choices are near-ties, that flips about half the steps
   (41-51% top-1 agreement measured on the H200), so top-1 agreement here says nothing about fp8 on
   trained weights. Correctness of the fp8 path is item 5 plus the CPU tests of the emulation.
5. The fp8 projection's GPU paths (W8A8: Triton quantization + `torch._scaled_mm`; W8A16: the skinny
   Triton kernel) against their float32 emulation on the same quantized numbers: relative L2 error
   under 1e-2.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from pagoda.service.llm import LLM
from pagoda.service.sampling_params import SamplingParams

TOP1_AGREEMENT = 0.99
NEW_TOKENS = 48


def widen_vocab(tokenizer_json: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """`tokenizer_json` (a byte-level BPE's tokenizer.json) with a vocabulary of `vocab_size` ids: each
    new id spells two existing pieces joined, so it decodes to word-like text, and no merge produces it,
    so encoding is unchanged.

    A random-weight model emits ids all over its vocabulary. With Llama-3's 128256 ids over SmolLM2's
    49152-token tokenizer, 62% of them decoded to nothing, and the streamed chunks that carry no text
    made the served inter-token latency look 2.6x longer than the server's."""
    from tokenizers import Tokenizer as Backend

    widened = copy.deepcopy(tokenizer_json)
    vocab: dict[str, int] = widened["model"]["vocab"]
    decode = Backend.from_str(json.dumps(tokenizer_json)).decode
    whole = [p for p, i in vocab.items() if len(p) > 1 and (text := decode([i])) and "\ufffd" not in text]
    pieces = sorted(whole)  # special tokens decode to nothing; byte fragments to U+FFFD
    next_id, k = len(vocab), 0
    while next_id < vocab_size:
        # Distinct (first, second) pairs for every k below len(pieces) ** 2.
        piece = pieces[k % len(pieces)] + pieces[(k * 7919 + k // len(pieces)) % len(pieces)]
        k += 1
        if piece not in vocab:
            vocab[piece] = next_id
            next_id += 1
    return widened


def _save(model: Any, folder: Path, tokenizer: Path) -> Path:
    """A checkpoint folder as Hugging Face writes it, with the given tokenizer files beside it (the
    vocabulary widened to the model's, see `widen_vocab`)."""
    from transformers import GenerationConfig

    model.save_pretrained(folder)
    GenerationConfig(bos_token_id=1, eos_token_id=[2]).save_pretrained(folder)
    shutil.copy(tokenizer / "tokenizer_config.json", folder / "tokenizer_config.json")
    tokenizer_json = json.loads((tokenizer / "tokenizer.json").read_text())
    widened = widen_vocab(tokenizer_json, model.config.vocab_size)
    (folder / "tokenizer.json").write_text(json.dumps(widened, ensure_ascii=False))
    return folder


def build_checkpoint(kind: str, folder: Path, tokenizer: Path, vocab: int) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=vocab, max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2
    )
    config: Any
    if kind == "llama-gqa4-d64-llama3rope":
        config = LlamaConfig(  # type: ignore[call-arg]
            **common,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512,
            },
            initializer_range=0.05,
        )
    else:  # qwen2, head dim 128, GQA 4, q/k/v bias
        config = Qwen2Config(  # type: ignore[call-arg]
            **common,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            rope_theta=1000000.0,
            initializer_range=0.05,
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _save(model, folder, tokenizer)


def _generate(folder: Path, batch: list[list[int]], params: SamplingParams, **engine_args: Any) -> list[Any]:
    """Outputs of a fresh engine on `folder` (a third of the GPU), released before returning, so the next
    engine or transformers gets the memory (and, under TP, the process group)."""
    llm = LLM(str(folder), gpu_memory_utilization=0.3, **engine_args)
    try:
        return llm.generate(batch, params)
    finally:
        release_llm(llm)


def release_llm(llm: LLM) -> None:
    """Shut `llm` down and give its GPU memory back, so the next engine or model gets it."""
    llm.shutdown()
    del llm.engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_llama_8b(folder: Path, tokenizer: Path) -> Path:
    """Llama-3.1-8B's shapes with random bf16 weights, built on the GPU (for `pagoda bench offline`): its
    131,072-token context with its llama3 rope scaling, as its config.json has, so long prompts fit."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config: Any = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return _save(model, folder, tokenizer)


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 16, 17, 33, 100, 257, 600)]


def hf_generate(model: Any, batch: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers `generate()`, greedy, one prompt at a time (no padding), new tokens only."""
    out = []
    with torch.inference_mode():
        for p in batch:
            ids = torch.tensor([p], device=model.device)
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(gen[0, len(p) :].tolist())
    return out


def teacher_forced(
    kind: str,
    folder: Path,
    hf: Any,
    batch: list[list[int]],
    quantization: str | None,
    device: str,
    rows: list[tuple[str, str, bool | None, str]],
    tp: int = 1,
    kv_cache_dtype: str = "auto",
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=1)
    outs = _generate(
        folder,
        batch,
        params,
        dtype="bfloat16",
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        device=device,
        tensor_parallel_size=tp,
    )
    # Teacher-forced on the engine's own bf16 continuation: fp32 transformers is the truth; bf16
    # transformers shows how far bf16 rounding alone moves top-1 choices on a random model.
    stats = {"ours": [0, 0.0], "hf_bf16": [0, 0.0]}  # top-1 agreements with fp32, worst |dlogprob|
    total = 0
    with torch.inference_mode():
        truth_model, bf16_model = hf, copy.deepcopy(hf).to(torch.bfloat16)
        for p, o in zip(batch, outs, strict=True):
            tokens = o.outputs[0].token_ids
            ids = torch.tensor([p + tokens], device=device)
            target = torch.tensor(tokens, device=device)[:, None]
            truth = torch.log_softmax(truth_model(ids).logits[0, len(p) - 1 : -1].float(), dim=-1)
            half = torch.log_softmax(bf16_model(ids).logits[0, len(p) - 1 : -1].float(), dim=-1)
            top1 = truth.argmax(dim=-1)
            truth_lp = truth.gather(1, target)[:, 0]
            ours_lp = torch.tensor([lp.logprob for lp in o.outputs[0].logprobs or []], device=device)
            stats["ours"][0] += int((top1 == target[:, 0]).sum())
            stats["ours"][1] = max(stats["ours"][1], float((ours_lp - truth_lp).abs().max()))
            stats["hf_bf16"][0] += int((top1 == half.argmax(dim=-1)).sum())
            stats["hf_bf16"][1] = max(
                stats["hf_bf16"][1], float((half.gather(1, target)[:, 0] - truth_lp).abs().max())
            )
            total += len(tokens)
        del bf16_model
    ours_agree, hf_agree = stats["ours"][0] / total, stats["hf_bf16"][0] / total
    ok: bool | None = None  # fp8: reported, not judged (item 4 above)
    if quantization is None and kv_cache_dtype == "auto":
        ok = ours_agree >= min(TOP1_AGREEMENT, hf_agree - 0.02) and (
            stats["ours"][1] <= 1.5 * stats["hf_bf16"][1] + 0.05
        )
    rows.append(
        (
            kind,
            f"{quantization or 'bf16'}{' + fp8 KV' if kv_cache_dtype == 'fp8' else ''} teacher-forced "
            "vs fp32 transformers",
            ok,
            f"top-1 ours {ours_agree:.1%} vs transformers-bf16 {hf_agree:.1%}; "
            f"max |dlogprob| ours {stats['ours'][1]:.3f} vs transformers-bf16 {stats['hf_bf16'][1]:.3f}",
        )
    )


def check(
    kind: str, folder: Path, rows: list[tuple[str, str, bool | None, str]], device: str = "cuda", tp: int = 1
) -> None:
    from transformers import AutoModelForCausalLM

    batch = prompts(49152)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    llm = LLM(
        str(folder),
        dtype="float32",
        device=device,
        max_num_batched_tokens=512,
        gpu_memory_utilization=0.3,
        tensor_parallel_size=tp,
    )
    assert device == "cpu" or llm.engine.runner.graphs is not None, "CUDA graphs should be on"
    ours = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=NEW_TOKENS)
    ours_seeded = [o.outputs[0].token_ids for o in llm.generate(batch, seeded)]
    is_async = llm.engine.core.is_async
    release_llm(llm)
    hf: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf = hf.to(device).eval()
    with torch.inference_mode():
        theirs = hf_generate(hf, batch)
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    rows.append(
        (kind, "fp32 greedy == transformers", same == len(batch), f"{same}/{len(batch)} prompts identical")
    )

    eager = _generate(
        folder, batch, params, dtype="float32", device=device, enforce_eager=True, tensor_parallel_size=tp
    )
    eager_out = [o.outputs[0].token_ids for o in eager]
    same = sum(a == b for a, b in zip(ours, eager_out, strict=True))
    rows.append((kind, "fp32 graphs == eager", same == len(batch), f"{same}/{len(batch)} prompts identical"))

    llm = LLM(
        str(folder), dtype="float32", device=device, max_num_batched_tokens=512, gpu_memory_utilization=0.3,
        tensor_parallel_size=tp, async_scheduling=False,
    )  # fmt: skip
    in_turn = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    in_turn_seeded = [o.outputs[0].token_ids for o in llm.generate(batch, seeded)]
    release_llm(llm)
    same = sum(a == b for a, b in zip(ours + ours_seeded, in_turn + in_turn_seeded, strict=True))
    rows.append(
        (kind, f"fp32 {'async' if is_async else 'default'} == in turn", same == 2 * len(batch),
         f"{same}/{2 * len(batch)} greedy and seeded outputs identical")
    )  # fmt: skip

    graphs, eager = (
        _generate(
            folder, batch, params, dtype="bfloat16", kv_cache_dtype="fp8", device=device, enforce_eager=e,
            tensor_parallel_size=tp,
        )
        for e in (False, True)
    )  # fmt: skip
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(graphs, eager, strict=True))
    rows.append(
        (kind, "bf16 + fp8 KV graphs == eager", same == len(batch), f"{same}/{len(batch)} prompts identical")
    )
    for quantization, kv_cache_dtype in ((None, "auto"), ("fp8", "auto"), (None, "fp8")):
        teacher_forced(kind, folder, hf, batch, quantization, device, rows, tp, kv_cache_dtype)
    del hf
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fp8_layer_check() -> tuple[str, str, bool | None, str]:
    from pagoda.service.model.fp8 import Fp8Linear

    torch.manual_seed(0)
    layer = Fp8Linear(torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02, None)
    errors = []
    paths = {"unit-scale mm + scale_product": 37, "row-wise _scaled_mm": 300}
    for num_rows in paths.values():
        x = torch.randn(num_rows, 4096, device="cuda", dtype=torch.bfloat16)
        layer.use_kernels = True
        fast = layer(x).float()
        layer.use_kernels = False
        emulated = layer(x).float()
        errors.append(float((fast - emulated).norm() / emulated.norm()))
    detail = ", ".join(
        f"{name} ({n} rows) rel. L2 {e:.2e}" for (name, n), e in zip(paths.items(), errors, strict=True)
    )
    # A product with its scales deferred: to the SiLU-and-mul that quantizes for down_proj (gate_up's),
    # and to the add + RMSNorm after o_proj and down_proj.
    from pagoda import kernels
    from pagoda.kernels.quant import quantize_fp8_rows
    from pagoda.service.model.fp8 import ScaledProduct

    def same_codes(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
        return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])

    layer.use_kernels = True
    rows = quantize_fp8_rows(torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16))
    deferred = layer.product_with_scales(rows)
    silu_ok = norm_ok = False
    if isinstance(deferred, ScaledProduct):
        fused = kernels.silu_and_mul(deferred.acc, True, deferred.scales, deferred.dtype)
        silu_ok = same_codes(fused, kernels.silu_and_mul(layer(rows), True))
        residual = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16)
        weight = (1 + 0.1 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
        normed, new_residual = kernels.rms_norm(
            deferred.acc, weight, 1e-5, residual, True, scales=deferred.scales, scaled_dtype=deferred.dtype
        )
        expected, expected_residual = kernels.rms_norm(layer(rows), weight, 1e-5, residual, True)
        norm_ok = same_codes(normed, expected) and torch.equal(new_residual, expected_residual)
    detail += (
        f"; deferred scales == scale_product first: in the SiLU {silu_ok}, in the add + RMSNorm {norm_ok}"
    )
    return (
        "Fp8Linear 4096x4096",
        "GPU kernels == float32 emulation",
        max(errors) < 1e-2 and silu_ok and norm_ok,
        detail,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", type=Path, required=True, help="folder with tokenizer.json")
    parser.add_argument(
        "--build-8b", type=Path, default=None, help="only build the 8B-shaped checkpoint here"
    )
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    parser.add_argument("--only", default=None, help="run one checkpoint kind")
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="run the engine's checks over this many GPUs"
    )
    args = parser.parse_args(argv)
    if args.build_8b is not None:
        build_llama_8b(args.build_8b, args.tokenizer)
        return 0
    rows: list[tuple[str, str, bool | None, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("llama-gqa4-d64-llama3rope", "qwen2-gqa4-d128-bias"):
            if args.only and kind != args.only:
                continue
            folder = build_checkpoint(kind, Path(tmp) / kind, args.tokenizer, 49152)
            try:
                check(kind, folder, rows, args.device, args.tensor_parallel_size)
            except Exception as exc:  # report and go on with the next checkpoint
                rows.append((kind, "crashed", False, f"{type(exc).__name__}: {exc}"))
    if args.device == "cuda":
        rows.append(fp8_layer_check())
    where = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"Device: {where}, torch {torch.__version__}, tensor parallel size {args.tensor_parallel_size}")
    print("| checkpoint | check | result | detail |\n| --- | --- | --- | --- |")
    for kind, name, ok, detail in rows:
        print(f"| {kind} | {name} | {'INFO' if ok is None else 'PASS' if ok else 'FAIL'} | {detail} |")
    return 0 if all(ok is not False for _, _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
