"""`pagoda bench grammar`: what structured output costs per engine step, and what it costs the others.

Runs the offline engine (the same `EngineCore` as `pagoda serve`) on one batch of decoding requests
three times: none with a grammar, half with one, all with one (a JSON Schema: an array of objects,
so a grammar request keeps going). It times every engine step, and reports the median decode step
(every request of the batch decoding) of each mix, next to the two parts that structured output adds:
the core's bitmask fill (llguidance, per grammar row) and the sampler's masking (per step, on the
logits' device). Output is a Markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from pagoda.bench.timing import device_name, emit_markdown, sync

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="checkpoint folder or .gguf (default: embedded SmolLM2)"
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    parser.add_argument("--batch", type=int, default=16, help="requests decoding together")
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3, help="each mix runs this many times, interleaved")
    parser.add_argument("--output", default=None, help="append the Markdown result to this file")


def _decode_steps(
    llm: Any, num_grammar: int, args: argparse.Namespace, tag: str
) -> tuple[list[tuple[float, float]], list[float]]:
    """(wall ms, process CPU ms) of each full decode step with `num_grammar` of `args.batch` requests
    constrained, and each step's bitmask fill per grammar row (µs)."""
    from pagoda.service.grammar import Grammar
    from pagoda.service.sampling_params import SamplingParams

    engine = llm.engine
    messages = [{"role": "user", "content": "List three people as JSON, with name, age and city."}]
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    grammar = Grammar.json_schema(SCHEMA)
    for i in range(args.batch):
        constrained = i < num_grammar
        params = SamplingParams(
            temperature=0,
            max_tokens=args.output_len,
            ignore_eos=not constrained,  # a constrained request ends when its JSON does
            grammar=grammar if constrained else None,
        )
        engine.add_request(f"{tag}-{i}", prompt, params)
    manager = engine.core.structured_output
    fill = manager.bitmask
    fill_us: list[float] = []

    def timed_fill(out: Any) -> Any:
        start = time.perf_counter()
        mask = fill(out)
        seconds = time.perf_counter() - start
        if mask is not None:
            fill_us.append(1e6 * seconds / len(mask.rows))
        return mask

    manager.bitmask = timed_fill  # type: ignore[method-assign]
    steps: list[tuple[float, float]] = []
    device = engine.runner.device
    try:
        while engine.has_unfinished:
            full = len(engine.scheduler.running) == args.batch and not engine.scheduler.waiting
            sync(device)
            start, cpu = time.perf_counter(), time.process_time()
            engine.step()
            sync(device)
            if full:
                steps.append((1000 * (time.perf_counter() - start), 1000 * (time.process_time() - cpu)))
    finally:
        manager.bitmask = fill  # type: ignore[method-assign]
    return steps[1:], fill_us[1:]


def _mask_apply_ms(device: Any, vocab: int, rows: int, repeats: int = 50) -> float:
    import numpy as np
    import torch

    from pagoda.service.engine.runner.sampler import BitmaskStaging, apply_token_bitmask

    logits = torch.randn(rows, vocab, device=device)
    bitmask = np.random.default_rng(0).integers(
        -(2**31), 2**31, size=(rows, (vocab + 31) // 32), dtype=np.int32
    )
    staging = BitmaskStaging() if logits.device.type == "cuda" else None  # page-locked, as in a step

    def bits() -> torch.Tensor:
        return staging.stage(bitmask) if staging is not None else torch.from_numpy(bitmask)

    apply_token_bitmask(logits, list(range(rows)), bits())
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        apply_token_bitmask(logits, list(range(rows)), bits())
    sync(device)
    return 1000 * (time.perf_counter() - start) / repeats


def run(args: argparse.Namespace) -> int:

    from pagoda.service.grammar import Grammar
    from pagoda.service.llm import LLM
    from pagoda.service.sampling_params import SamplingParams

    mixes = (0, args.batch // 2, args.batch)
    steps: dict[int, list[tuple[float, float]]] = {m: [] for m in mixes}
    fills: dict[int, list[float]] = {m: [] for m in mixes}
    with LLM(
        args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.batch, max_model_len=1024
    ) as llm:
        runner = llm.engine.runner
        vocab = runner.model_config.vocab_size
        # Warm up: the first grammar loads the tokenizer into llguidance (seconds, once per process).
        llm.generate("Hi", SamplingParams(max_tokens=4, grammar=Grammar.json_schema(SCHEMA)))
        # Rounds interleave the mixes, so a neighbour's load on a shared machine spreads over all three.
        for round_ in range(args.rounds):
            for num_grammar in mixes:
                timed, fill_us = _decode_steps(llm, num_grammar, args, f"{round_}-{num_grammar}")
                steps[num_grammar] += timed
                fills[num_grammar] += fill_us
        apply_ms = _mask_apply_ms(runner.device, vocab, args.batch)
        device = device_name(runner.device)
    base_wall = statistics.median(w for w, _ in steps[0])
    base_cpu = statistics.median(c for _, c in steps[0])
    command = (
        f"pagoda bench grammar --batch {args.batch} --output-len {args.output_len} --rounds {args.rounds}"
    )
    lines = [
        f"### structured output: {args.batch} requests decoding, {args.model or 'SmolLM2-135M (embedded)'}",
        "",
        f"Device: {device}. Command: `{command}`",
        "",
        "| requests with a grammar | decode steps timed | median step ms | vs none "
        "| median step CPU ms | vs none | bitmask fill µs per grammar row (median) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for num_grammar in mixes:
        wall = statistics.median(w for w, _ in steps[num_grammar])
        cpu = statistics.median(c for _, c in steps[num_grammar])
        fill = f"{statistics.median(fills[num_grammar]):.1f}" if fills[num_grammar] else ""
        lines.append(
            f"| {num_grammar} of {args.batch} | {len(steps[num_grammar])} | {wall:.1f} "
            f"| {wall / base_wall:.2f}x | {cpu:.1f} | {cpu / base_cpu:.2f}x | {fill} |"
        )
    lines += ["", f"Sampler mask for {args.batch} rows x {vocab} tokens: {apply_ms:.3f} ms per step."]
    emit_markdown(lines, args.output)
    return 0
