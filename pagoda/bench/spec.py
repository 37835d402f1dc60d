"""`pagoda bench spec`: speculative decoding (prompt lookup) against none, on one loaded engine.

Two workloads, each run with drafts and without on the same engine (the speculator switched on and
off between runs), greedy, so that the outputs must be equal token for token:

- copy: a passage and the instruction to repeat it, the case prompt lookup is for (on the embedded
  SmolLM2 a real model copies; on random weights the output does not, and this measures misses);
- code: a function and the instruction to rename one of its variables (an edit: most of the output
  is the input);
- random: prompts of random tokens, whose output never repeats them: what drafting costs when it
  fails, at each batch size (the load rule and the pauses should keep it near zero).

Reports output tok/s with and without, the acceptance (kept / drafted tokens), the mean tokens a
drafting sequence emits per step, and how many outputs are equal (and, for scale, how many two runs
without drafts agree on: bf16 near-ties on random weights flip between kernels).

`--echo` turns the loaded checkpoint into one that repeats its last token at the same cost per step
(the embedding scaled up so it dominates the residual stream, the LM head set to the embedding): every
draft of a repeated token is right, so it measures what speculation gains at full acceptance on that
model's shapes; random weights without it measure the other end, drafts that never come or miss.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from pagoda.bench.timing import device_name, timed_generate

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs each evening at dusk, carrying a tin of oil and a "
    "cloth. He trimmed the wick, polished the great lens until it shone, and wrote the weather in his "
    "logbook: wind from the west, seas moderate, two ships passing north before midnight. In winter "
    "the storms came without warning, and he stayed awake through the night, listening to the waves "
    "break against the rocks below. When the supply boat came in spring, he asked only for books, "
    "lamp oil, and news of the mainland."
)


CODE = """def moving_average(values, window):
    total = 0.0
    averages = []
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="checkpoint folder or .gguf (default: embedded SmolLM2)"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--max-batch-tokens", type=int, default=128, help="the load rule's row cap")
    parser.add_argument(
        "--no-adaptive", action="store_true",
        help="the measured rule off: every step the load rule allows drafts (the config's adaptive: false)",
    )  # fmt: skip
    parser.add_argument("--copy-batches", default="1,8", help="batch sizes of the copy and code workloads")
    parser.add_argument("--random-batches", default="1,16,64,256", help="batch sizes of the random workload")
    parser.add_argument("--input-len", type=int, default=256, help="the random workload's prompt length")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--echo", action="store_true", help="make the model repeat its last token (above)")
    parser.add_argument(
        "--draft-model",
        default=None,
        help="draft with this checkpoint (same tokenizer) instead of prompt lookup; the target itself: a "
        "draft that always agrees at a draft model's full cost",
    )
    parser.add_argument(
        "--busy-steps",
        type=int,
        default=0,
        help="also profile this many steady steps at each random-workload batch, plain and drafting at "
        "every step (the measured rule off): wall and GPU-busy ms per step and tokens per step",
    )
    parser.add_argument(
        "--busy-top", type=int, default=0, help="with --busy-steps: the K kernels with the most GPU time"
    )
    parser.add_argument("--output", default=None, help="append the Markdown result to this file")


def _copy_prompts(llm: Any, batch: int, workload: str) -> list[list[int]]:
    if workload == "code":
        text = (
            f"```python\n{CODE}```\n\nThe same function with `total` renamed to `running_sum`:\n\n```python\n"
        )
    else:
        text = f"Here is a passage.\n\n{PASSAGE}\n\nRepeat the passage word for word.\n\n"
    ids = llm.tokenizer.encode(text)
    return [list(ids) for _ in range(batch)]


def _random_prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(batch)]


def run(args: argparse.Namespace) -> int:

    from pagoda.service.engine.config import SpeculativeConfig
    from pagoda.service.engine.core.speculation import Speculator
    from pagoda.service.llm import LLM
    from pagoda.service.sampling_params import SamplingParams

    config = SpeculativeConfig(
        method="draft_model" if args.draft_model else "ngram",
        model=args.draft_model,
        num_speculative_tokens=args.num_speculative_tokens,
        max_batch_tokens=args.max_batch_tokens,
        adaptive=not args.no_adaptive,
    )
    copy_batches = [int(b) for b in args.copy_batches.split(",") if b]
    batches = {
        "copy": copy_batches,
        "code": copy_batches,
        "random": [int(b) for b in args.random_batches.split(",") if b],
    }
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        max_num_seqs=max(max(b) for b in batches.values() if b),
        max_num_batched_tokens=4096,
        speculative_config=config if args.draft_model else None,  # the draft model loads with the engine
    )
    core, runner = llm.engine.core, llm.engine.runner
    propose = core.executor.propose_drafts if args.draft_model else None
    vocab = runner.model_config.vocab_size
    if args.echo:
        make_echo(runner.model)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(_random_prompts(2, 16, vocab), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))

    def timed(prompts: list[list[int]], speculate: bool) -> tuple[float, list[list[int]], Any]:
        core.speculator = Speculator(config, core.max_model_len, propose) if speculate else None
        seconds, outs = timed_generate(llm, runner.device, prompts, params)
        stats = core.speculator.stats if core.speculator else None
        return seconds, [o.outputs[0].token_ids for o in outs], stats

    echo = " as an echo" if args.echo else ""
    lines = [
        f"### speculative decoding ({args.draft_model or 'ngram'}, k={config.num_speculative_tokens}, "
        f"max_batch_tokens="
        f"{config.max_batch_tokens}): {args.model or 'embedded SmolLM2-135M'}{echo}, "
        f"{args.quantization or args.dtype}, {args.output_len} out, greedy",
        "",
        f"Device: {device_name(runner.device)}.",
        "",
        "| workload | batch | off tok/s | on tok/s | on / off | kept / drafted | tokens per drafting step "
        "| same output (off twice) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for workload, sizes in batches.items():
        for batch in sizes:
            if workload in ("copy", "code"):
                prompts = _copy_prompts(llm, batch, workload)
            else:
                prompts = _random_prompts(batch, args.input_len, vocab)
            timed(prompts[:1], True)  # the drafting shapes' first compile, untimed
            off_s, off_tokens, _ = timed(prompts, False)
            on_s, on_tokens, stats = timed(prompts, True)
            _, off_again, _ = timed(prompts, False)
            same = sum(a == b for a, b in zip(off_tokens, on_tokens, strict=True))
            noise = sum(a == b for a, b in zip(off_tokens, off_again, strict=True))
            out_tokens = sum(len(t) for t in on_tokens)
            kept = f"{stats.num_accepted_tokens} / {stats.num_draft_tokens}"
            per_step = 1 + stats.num_accepted_tokens / stats.num_drafts if stats.num_drafts else 1.0
            lines.append(
                f"| {workload} | {batch} | {out_tokens / off_s:.1f} | {out_tokens / on_s:.1f} "
                f"| {on_s and off_s / on_s:.2f} | {kept} | {per_step:.2f} | {same}/{batch} ({noise}) |"
            )
            print(lines[-1], flush=True)
    if args.busy_steps > 0:
        lines += _profile_steps(llm, config, propose, batches["random"], args)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        with open(args.output, "a") as f:
            f.write("\n" + text)
    llm.shutdown()
    return 0


def _profile_steps(
    llm: Any, config: Any, propose: Any, batches: list[int], args: argparse.Namespace
) -> list[str]:
    """Where a drafting step's time goes, against a plain one: `--busy-steps` steady steps at each batch
    (random prompts), without drafts and drafting at every step the load rule allows (the measured rule
    off), each as wall and GPU-busy ms per step (the idle is the host's share: a drafting step runs in
    turn) and output tokens per step; `--busy-top` kernels under each."""
    from dataclasses import replace

    from pagoda.bench.offline import decode_busy
    from pagoda.service.engine.core.speculation import Speculator

    core = llm.engine.core
    always = replace(config, adaptive=False)
    lines = [
        "",
        f"Steady steps profiled ({args.busy_steps} each, random prompts of {args.input_len} tokens):",
        "",
        "| batch | drafts | wall ms / step | GPU busy ms / step | idle ms / step | output tokens / step |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    vocab = llm.engine.runner.model_config.vocab_size
    for batch in batches:
        prompts = _random_prompts(batch, args.input_len, vocab)
        for drafting in (False, True):
            core.speculator = Speculator(always, core.max_model_len, propose) if drafting else None
            k = config.num_speculative_tokens
            wall, busy, tokens = decode_busy(llm, prompts, args.busy_steps, args.busy_top, None, k + 1)
            lines.append(
                f"| {batch} | {'on' if drafting else 'off'} | {wall:.2f} | {busy:.2f} | {wall - busy:.2f} | "
                f"{tokens:.2f} |"
            )
            print(lines[-1], flush=True)
    return lines


def make_echo(model: Any) -> None:
    """In place (CUDA graphs read the same storage): the LM head := the embedding, the embedding x64.
    The final norm then sees mostly the input token's embedding, whose dot product with itself beats
    every other row's (random rows of a wide embedding are near orthogonal)."""
    import torch

    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
        model.model.embed_tokens.weight.mul_(64.0)
