"""`pagoda bench lora`: decode with many LoRA adapters in one batch against the base model alone, on
one loaded engine.

`--num-adapters` random adapters of rank `--rank` on every decoder projection are written in PEFT's
format (safetensors, no PEFT needed, so the GPU machine runs it) and loaded into as many slots. The
same random prompts run twice per batch size: every request on the base model, then the requests spread
round-robin over the adapters. Reports output tok/s of each and their ratio (issue 35's goal: 85% of
the base at batch 64 with 8 rank-16 adapters on an 8B-shaped model in bf16).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

from pagoda.bench.timing import device_name, timed_generate

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="checkpoint folder or .gguf (default: embedded SmolLM2)"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batches", default="1,64", help="batch sizes, comma-separated")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--busy-steps",
        type=int,
        default=0,
        help="also profile this many steady decode steps at each batch, the base alone and with the "
        "adapters: wall, GPU-busy and idle ms per step (where the adapters' time goes)",
    )
    parser.add_argument(
        "--busy-top",
        type=int,
        default=0,
        help="with --busy-steps: print the K kernels with the most GPU time",
    )
    parser.add_argument("--output", default=None, help="append the Markdown result to this file")


def write_random_adapter(model_config: Any, folder: Path, rank: int, seed: int, b_std: float = 0.01) -> Path:
    """A PEFT LoRA folder for `model_config` with random A and B on every decoder projection (B's
    standard deviation `b_std`: small, the output barely moves; large, it changes)."""
    import torch
    from safetensors.torch import save_file

    from pagoda.service.model.lora import module_shapes

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_hidden_layers):
        for module, (fan_in, fan_out) in module_shapes(model_config).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * b_std
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
        folder / "adapter_model.safetensors",
    )
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def run(args: argparse.Namespace) -> int:

    from pagoda.service.llm import LLM, LoRARequest
    from pagoda.service.sampling_params import SamplingParams

    batches = [int(b) for b in args.batches.split(",") if b]
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        max_num_seqs=max(batches),
        max_num_batched_tokens=4096,
        enforce_eager=args.enforce_eager,
        enable_lora=True,
        max_loras=args.num_adapters,
        max_lora_rank=args.rank,
    )
    runner = llm.engine.runner
    vocab = runner.model_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [
            LoRARequest(
                f"a{i}",
                i + 1,
                str(write_random_adapter(runner.model_config, Path(tmp) / f"a{i}", args.rank, i)),
            )
            for i in range(args.num_adapters)
        ]

        def timed(
            prompts: list[list[int]], loras: list[LoRARequest | None], sampling: Any = params
        ) -> tuple[float, int]:
            seconds, outs = timed_generate(llm, runner.device, prompts, sampling, lora_request=loras)
            return seconds, sum(len(o.outputs[0].token_ids) for o in outs)

        warm = [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(len(adapters))]
        timed(warm, list(adapters))  # loads every adapter into its slot, compiles the kernels: untimed
        lines = [
            f"### multi-LoRA: {args.model or 'embedded SmolLM2-135M'}, {args.quantization or args.dtype}, "
            f"{args.num_adapters} adapters of rank {args.rank} on every projection, {args.input_len} in / "
            f"{args.output_len} out, greedy{', eager' if args.enforce_eager else ''}",
            "",
            f"Device: {device_name(runner.device)}.",
            "",
            "| batch | base tok/s | adapters tok/s | adapters / base |",
            "| ---: | ---: | ---: | ---: |",
        ]
        for batch in batches:
            prompts, mixed = _batch(rng, batch, vocab, args.input_len, adapters)
            # Untimed, both ways: the batch's prefill and decode shapes compile their kernels here, not
            # in the timed runs (on an H100 the bf16 run, first in its call, gave 0.52 at batch 64 and
            # the fp8-base run after it 0.78: compiles inside the timing are the likely difference).
            for loras in ([None] * batch, mixed):
                timed(prompts, loras, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            base_s, base_tokens = timed(prompts, [None] * batch)
            lora_s, lora_tokens = timed(prompts, mixed)
            lines.append(
                f"| {batch} | {base_tokens / base_s:.1f} | {lora_tokens / lora_s:.1f} "
                f"| {base_s / lora_s * lora_tokens / base_tokens:.2f} |"
            )
            print(lines[-1], flush=True)
        if args.busy_steps > 0:
            lines += _profile_steps(llm, adapters, batches, vocab, args)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        with open(args.output, "a") as f:
            f.write("\n" + text)
    llm.shutdown()
    return 0


def _batch(
    rng: random.Random, batch: int, vocab: int, input_len: int, adapters: list[Any]
) -> tuple[list[list[int]], list[Any]]:
    """`batch` random prompts of `input_len` tokens, and the adapters spread over them round-robin."""
    prompts = [[rng.randrange(3, vocab) for _ in range(input_len)] for _ in range(batch)]
    return prompts, [adapters[i % len(adapters)] for i in range(batch)]


def _profile_steps(
    llm: Any, adapters: list[Any], batches: list[int], vocab: int, args: argparse.Namespace
) -> list[str]:
    """`--busy-steps` steady decode steps at each batch, the base alone and the adapters round-robin
    (`bench offline`'s `decode_busy`): wall, GPU-busy and idle ms a step, the top kernels under each."""
    from pagoda.bench.offline import decode_busy

    rng = random.Random(1)
    lines = [
        "",
        f"Steady decode steps profiled ({args.busy_steps} each, prompts of {args.input_len} tokens):",
        "",
        "| batch | adapters | wall ms / step | GPU busy ms / step | idle ms / step |",
        "| ---: | --- | ---: | ---: | ---: |",
    ]
    for batch in batches:
        prompts, loras = _batch(rng, batch, vocab, args.input_len, adapters)
        base: list[str | None] = [None] * batch
        mixed: list[str | None] = [lora.lora_name for lora in loras]
        for names in (base, mixed):
            wall, busy, _ = decode_busy(llm, prompts, args.busy_steps, args.busy_top, None, 1, names)
            which = "none" if names[0] is None else f"{len(set(names))} of rank {args.rank}"
            lines.append(f"| {batch} | {which} | {wall:.2f} | {busy:.2f} | {wall - busy:.2f} |")
            print(lines[-1], flush=True)
    return lines
