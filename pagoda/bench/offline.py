"""`pagoda bench`: measure the engine against its peer on the same model, the same machine, the same run.

- `pagoda bench offline`: N prompts of fixed length through the engine's offline API, against Hugging
  Face `transformers` `generate()` on the same checkpoint; also single-stream decode latency.
- `pagoda bench serve`: a running OpenAI-compatible server under load (`pagoda.bench.serve`).
- `pagoda bench grammar`: structured output's cost per engine step (`pagoda.bench.grammar`).
- `pagoda bench sampler`: what seeded requests cost the sampler, against a generator per row.
- `pagoda bench kernels`: the Triton kernels against their peers (see `pagoda.bench.kernels`).

Results print as a Markdown table; `--output FILE` appends it with the command and the device.
"""

from __future__ import annotations

import argparse
import gc
import random
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagoda.bench.timing import device_name, emit_markdown, sync

if TYPE_CHECKING:
    from pagoda.service.outputs import RequestOutput

HELP = "Benchmark the engine or the kernels against their peers (results for BENCHMARKS.md)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    offline = sub.add_parser(
        "offline",
        help="engine vs transformers generate() on N fixed-length prompts",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    offline.add_argument(
        "--model", default=None, help="checkpoint folder or .gguf (default: embedded SmolLM2)"
    )
    offline.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    offline.add_argument("--quantization", choices=["fp8"], default=None, help="W8A8 fp8 projections")
    offline.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    offline.add_argument("--device", default="auto")
    offline.add_argument("--num-prompts", type=int, default=16)
    offline.add_argument("--input-len", type=int, default=128)
    offline.add_argument("--output-len", type=int, default=128)
    offline.add_argument("--max-num-batched-tokens", type=int, default=4096)
    offline.add_argument("--tensor-parallel-size", type=int, default=1)
    offline.add_argument(
        "--cuda-graph-max-tokens", type=int, default=2048, help="0: only decode steps replay CUDA graphs"
    )
    offline.add_argument(
        "--max-cudagraph-capture-size",
        type=int,
        default=1024,
        help="largest decode batch that replays a decode CUDA graph (past 256 the sizes step by 128)",
    )
    offline.add_argument(
        "--long-prefill-attention",
        choices=["paged", "cudnn"],
        default="cudnn",
        help="prompt chunks of 4096+ tokens through the Triton kernel or cuDNN's fused attention",
    )
    offline.add_argument(
        "--long-chunk-tokens",
        type=_at_least_one,
        default=None,
        help="a benchmark knob: prompt chunks of this many tokens or more attend through cuDNN (the "
        "engine's threshold is LONG_CHUNK_TOKENS, 4096; needs --long-prefill-attention cudnn, one rank)",
    )
    offline.add_argument(
        "--whole-prompt-tokens",
        type=int,
        default=None,
        help="a benchmark knob: whole prompts (no cached prefix) of this many tokens or more attend through "
        "cuDNN on the step's own keys and values (the engine's threshold is WHOLE_PROMPT_TOKENS, 2048); 0: "
        "none do, below the long-chunk threshold (needs --long-prefill-attention cudnn, one rank)",
    )
    offline.add_argument("--peer", choices=["transformers", "none"], default="transformers")
    offline.add_argument(
        "--executor-class",
        default=None,
        help="another model side, as `pagoda serve`'s flag: "
        "pagoda.service.engine.runner.null_executor:NullExecutor times the engine's host work alone "
        "(scheduling, KV blocks, outputs) with no forward pass; use with --peer none",
    )
    offline.add_argument(
        "--repeat",
        type=_at_least_one,
        default=1,
        help="time the largest batch this many times on the loaded engine (a row each, and their median): "
        "runs of one engine differ by a few percent",
    )
    offline.add_argument(
        "--async-scheduling",
        choices=["auto", "on", "off", "both"],
        default="auto",
        help="both: every batch with async scheduling and with steps in turn, on the same loaded engine",
    )
    offline.add_argument(
        "--busy-steps",
        type=int,
        default=0,
        help="profile this many steady decode steps at the largest batch: wall and GPU-busy ms per step",
    )
    offline.add_argument(
        "--busy-trace",
        default=None,
        help="with --busy-steps: also record the host's calls and write a Chrome trace of those steps "
        "(chrome://tracing, Perfetto) to this file, to see what the GPU waits on between kernels; "
        "on the CPU, the host's trace alone. With --profile-prefill: the prefill's, to PATH with "
        "'.prefill' before its extension",
    )
    offline.add_argument(
        "--busy-top",
        type=int,
        default=0,
        help="with --busy-steps or --profile-prefill: print the K kernels with the most GPU time",
    )
    offline.add_argument(
        "--profile-prefill",
        action="store_true",
        help="time the prefill of all N prompts at once (wall, and GPU-busy on a GPU) and the TFLOP/s "
        "of its projections",
    )
    offline.add_argument("--output", default=None, help="append the Markdown result to this file")
    serve = sub.add_parser(
        "serve",
        help="load a running OpenAI-compatible server (TTFT, ITL, throughput)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from pagoda.bench import serve as bench_serve

    bench_serve.add_arguments(serve)
    grammar = sub.add_parser(
        "grammar",
        help="structured output's cost per decode step (batches with and without grammar requests)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from pagoda.bench import grammar as bench_grammar

    bench_grammar.add_arguments(grammar)
    sampler = sub.add_parser(
        "sampler",
        help="the sampler's step with seeded rows against a torch.Generator per seeded row",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from pagoda.bench import sampler as bench_sampler

    bench_sampler.add_arguments(sampler)
    routing = sub.add_parser(
        "routing",
        help="simulate routing policies and HPA settings over 16 to 1,024 replicas (docs/routing.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from pagoda.bench import routing_sim

    routing_sim.add_arguments(routing)
    spec = sub.add_parser(
        "spec",
        help="speculative decoding (prompt lookup) against none on one engine: copy and random workloads",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from pagoda.bench import spec as bench_spec

    bench_spec.add_arguments(spec)
    lora = sub.add_parser(
        "lora",
        help="decode with many LoRA adapters in one batch against the base model alone, on one engine",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from pagoda.bench import lora as bench_lora

    bench_lora.add_arguments(lora)
    kernels = sub.add_parser("kernels", help="Triton kernels vs references and SDPA (needs a CUDA GPU)")
    from pagoda.bench import kernels as bench_kernels

    bench_kernels.add_arguments(kernels)


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a count of at least 1, got {text!r}")
    return int(text)


@dataclass
class Result:
    system: str
    batch: int
    seconds: float
    output_tokens: int
    decode_ms_per_token: float | None = None
    ttft_ms: float | None = None
    preemptions: int | None = None  # requests the scheduler preempted (KV cache full) during the run
    # A batch's two phases: seconds until its last request's first token (its prompts done), then the
    # ms of each step after (the last request's remaining output_len - 1 tokens, decode only).
    last_first_token_s: float | None = None
    decode_ms_per_step: float | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds


def batch_phases(
    outs: list[RequestOutput], start: float, end: float, output_len: int
) -> tuple[float, float | None]:
    """(seconds from `start` to the batch's last first token, ms a step after it), `start` and `end` on
    the requests' clock (time.monotonic). Where a grid row's time goes: its prompts (and the decode
    steps mixed with them), then the decode steps alone."""
    firsts = [o.metrics.first_token_time for o in outs]
    if not firsts or None in firsts:
        raise ValueError("batch_phases: every request needs its first token's time")
    last_first = max(t for t in firsts if t is not None)
    after = 1000 * (end - last_first) / (output_len - 1) if output_len > 1 else None
    return last_first - start, after


def random_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(num)]


@dataclass
class Setup:
    """What the peer needs to run on the same device, dtype and vocabulary."""

    device: Any
    dtype: Any
    vocab_size: int
    max_model_len: int


def bench_engine(args: argparse.Namespace) -> tuple[list[Result], Setup]:
    from pagoda.service.llm import LLM
    from pagoda.service.sampling_params import SamplingParams

    if args.long_chunk_tokens is not None and (
        args.long_prefill_attention != "cudnn" or args.tensor_parallel_size != 1
    ):
        raise SystemExit("--long-chunk-tokens: only with --long-prefill-attention cudnn on one rank")
    if args.whole_prompt_tokens is not None and (
        args.long_prefill_attention != "cudnn"
        or args.tensor_parallel_size != 1
        or args.whole_prompt_tokens < 0
    ):
        raise SystemExit(
            "--whole-prompt-tokens: 0 or more, only with --long-prefill-attention cudnn on one rank"
        )
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        max_num_seqs=max(args.num_prompts, 1),
        max_num_batched_tokens=args.max_num_batched_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
        cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        max_cudagraph_capture_size=args.max_cudagraph_capture_size,
        long_prefill_attention=args.long_prefill_attention,
        executor_class=args.executor_class,
    )
    runner = llm.engine.runner
    if args.long_chunk_tokens is not None:
        runner.runner.long_chunk_tokens = args.long_chunk_tokens  # the ModelRunner's eager steps read it
    if args.whole_prompt_tokens is not None:
        runner.runner.whole_prompt_tokens = args.whole_prompt_tokens or None
    vocab = runner.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm_up = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(random_prompts(2, 16, vocab, seed=99), warm_up)
    # The largest batch once untimed: its prefill shapes compile, page-locked buffers are allocated.
    llm.generate(random_prompts(args.num_prompts, args.input_len, vocab, seed=98), warm_up)
    core = llm.engine.core
    # `both` runs in turn twice: the second tells run-to-run noise (bf16 near-ties on random weights)
    # from a real difference between the modes.
    modes = {"auto": [core.is_async], "on": [True], "off": [False], "both": [False, True, False]}
    results = []
    tokens: dict[tuple[int, bool], list[list[int]]] = {}  # (batch, async) -> every request's tokens
    for batch in (1, args.num_prompts):
        prompts = random_prompts(batch, args.input_len, vocab)
        runs = list(enumerate(modes[args.async_scheduling])) * (args.repeat if batch > 1 else 1)
        for run, (repeat, is_async) in enumerate(runs):
            core.is_async = is_async
            # Every timed run computes its prompts in full: the repeats and the modes of `both` run
            # the same prompts, which the prefix cache would otherwise hand them (it did before 2026-12-02:
            # `both`'s second and third runs skipped most of their prefill).
            if not llm.reset_prefix_cache():
                raise RuntimeError("bench offline: requests still hold KV blocks between runs")
            sync(runner.device)
            preempted = core.scheduler.num_preemptions
            start, start_clock = time.perf_counter(), time.monotonic()
            outs = llm.generate(prompts, params)
            sync(runner.device)
            seconds = time.perf_counter() - start
            phases = batch_phases(outs, start_clock, time.monotonic(), args.output_len) if batch > 1 else None
            if repeat < 2:
                tokens[batch, is_async] = [o.outputs[0].token_ids for o in outs]
            else:
                again = [o.outputs[0].token_ids for o in outs]
                same = sum(a == b for a, b in zip(tokens[batch, False], again, strict=True))
                print(f"batch {batch}: in turn == in turn again for {same}/{batch} requests")
            decode_ms = ttft_ms = None
            if batch == 1:
                m = outs[0].metrics
                assert m.first_token_time is not None and m.last_token_time is not None
                decode_ms = 1000 * (m.last_token_time - m.first_token_time) / max(args.output_len - 1, 1)
                ttft_ms = 1000 * (m.first_token_time - m.arrival_time)
            name = "pagoda" + ("" if len(modes[args.async_scheduling]) == 1 else _mode_name(is_async))
            name += " again" if repeat == 2 else ""
            per_round = len(modes[args.async_scheduling])
            name += f", run {run // per_round + 1}" if len(runs) > per_round else ""
            preempted = core.scheduler.num_preemptions - preempted
            output_tokens = batch * args.output_len
            results.append(
                Result(name, batch, seconds, output_tokens, decode_ms, ttft_ms, preempted, *(phases or ()))
            )
        if len(modes[args.async_scheduling]) > 1:
            same = sum(a == b for a, b in zip(tokens[batch, True], tokens[batch, False], strict=True))
            print(f"batch {batch}: async == in turn for {same}/{batch} requests")
    on_gpu = runner.device.type == "cuda"
    if args.busy_steps > 0 and (on_gpu or args.busy_trace):
        for is_async in sorted(set(modes[args.async_scheduling])):
            core.is_async = is_async
            prompts = random_prompts(args.num_prompts, args.input_len, vocab)
            trace = _trace_path(args.busy_trace, is_async, len(modes[args.async_scheduling]) > 1)
            wall, busy, _ = decode_busy(llm, prompts, args.busy_steps, args.busy_top, trace)
            line = f"decode at batch {args.num_prompts}{_mode_name(is_async)}: {wall:.2f} ms/step wall"
            if on_gpu:
                idle = wall - busy
                line += f", GPU busy {busy:.2f} ms/step ({100 * busy / wall:.0f}%), idle {idle:.2f} ms/step"
                line += busy_caveat(runner.device)
            print(line + (f"; trace {trace}" if trace else ""))
    if args.profile_prefill:
        print(
            _prefill_profile(
                llm,
                random_prompts(args.num_prompts, args.input_len, vocab, seed=7),
                args.busy_top,
                _prefill_trace_path(args.busy_trace),
            )
        )
    setup = Setup(runner.device, runner.dtype, vocab, runner.max_model_len)
    llm.shutdown()
    del llm, runner  # free the weights and the KV cache before the peer loads its copy
    gc.collect()
    if setup.device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
    return results, setup


def _mode_name(is_async: bool) -> str:
    return " (async)" if is_async else " (in turn)"


def _prefill_trace_path(path: str | None) -> str | None:
    """`--busy-trace`'s file for `--profile-prefill`: `trace.json` -> `trace.prefill.json`."""
    if path is None:
        return None
    stem, dot, ext = path.rpartition(".")
    return f"{stem}.prefill.{ext}" if dot else f"{path}.prefill"


def _trace_path(path: str | None, is_async: bool, both_modes: bool) -> str | None:
    """`--busy-trace`'s file for one scheduling mode: `trace.json` -> `trace.async.json` when both run."""
    if path is None or not both_modes:
        return path
    stem, dot, ext = path.rpartition(".")
    mode = "async" if is_async else "in-turn"
    return f"{stem}.{mode}.{ext}" if dot else f"{path}.{mode}"


@contextmanager
def _annotated_phases(engine: Any) -> Iterator[None]:
    """Name the engine's phases in a profiler trace (`record_function`), without touching its code:
    the step, scheduling, the launch (input preparation, the forward pass, sampling), taking the
    previous step's tokens, and building outputs. Restored on exit."""
    from torch.profiler import record_function

    runner = getattr(engine.runner, "runner", None)  # the ModelRunner of rank 0, when there is one
    phases = [
        (engine, "step", "engine: step"),
        (engine.output_processor, "process", "engine: outputs"),
        (engine.core, "_complete", "core: take tokens"),
        (engine.core.scheduler, "schedule", "core: schedule"),
        (engine.core.scheduler, "advance", "core: advance"),
        (engine.core.executor, "launch", "executor: launch"),
        (runner, "prepare", "runner: prepare inputs"),
        (runner, "forward", "runner: forward"),
        (runner, "finish", "runner: sample"),
    ]
    wrapped = []
    for owner, name, label in phases:
        if owner is None or not hasattr(owner, name):
            continue
        original = getattr(owner, name)

        def call(*args: Any, _original: Any = original, _label: str = label, **kwargs: Any) -> Any:
            with record_function(_label):
                return _original(*args, **kwargs)

        own = vars(owner).get(name)  # an attribute of the instance itself, to be put back as it was
        setattr(owner, name, call)  # else the instance attribute shadows the class's method until removed
        wrapped.append((owner, name, own))
    try:
        yield
    finally:
        for owner, name, own in wrapped:
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


def decode_busy(
    llm: Any,
    prompts: list[list[int]],
    steps: int,
    top: int = 0,
    trace: str | None = None,
    tokens_per_step: int = 1,
    lora_names: list[str | None] | None = None,
) -> tuple[float, float, float]:
    """Wall and GPU-busy milliseconds per steady decode step (every request past its prefill), the
    busy time being the sum of the CUDA kernels the profiler saw in those steps (0 on the CPU), and
    the output tokens a step completed. `top`:
    print that many kernels, most GPU time first, with their time per step. `trace`: also record the
    host's calls, and write the steps' Chrome trace there (the host's share of the wall time grows a
    little under the recording). `tokens_per_step`: the most a step emits per sequence (speculation:
    k + 1), so that no sequence ends before the profiled steps do. `lora_names`: each prompt's LoRA
    adapter (None: the base), of those the engine serves already."""
    from torch.profiler import ProfilerActivity, profile

    from pagoda.service.sampling_params import SamplingParams

    engine = llm.engine
    device = engine.runner.device
    params = SamplingParams(temperature=0.0, max_tokens=(steps + 64) * tokens_per_step, ignore_eos=True)
    names = lora_names or [None] * len(prompts)
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        engine.add_request(
            f"busy-{i}", prompt, params, final_only=True, lora_name=name
        )  # as LLM.generate does
    for _ in range(32):  # prefills, and the ramp to a steady batch
        engine.step()
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else []
    activities += [ProfilerActivity.CPU] if trace else []
    sync(device)
    profiler = profile(activities=activities) if activities else nullcontext()  # the CPU: wall time alone
    with profiler as prof, _annotated_phases(engine) if trace else nullcontext():
        start, tokens = time.perf_counter(), engine.core.generation_tokens_total
        for _ in range(steps):
            engine.step()
        sync(device)
        wall, tokens = time.perf_counter() - start, engine.core.generation_tokens_total - tokens
    if trace and prof is not None:
        prof.export_chrome_trace(trace)
    kernels = device_work(prof.key_averages()) if prof is not None else []
    busy_us = sum(e.self_device_time_total for e in kernels)
    for line in _top_kernels(kernels, steps, top):
        print(line)
    for i in range(len(prompts)):
        engine.abort(f"busy-{i}")
    while engine.has_unfinished or engine.core.has_unfinished:
        engine.step()
    return 1000 * wall / steps, busy_us / 1000 / steps, tokens / steps


def projection_params(mc: Any) -> int:
    """Weights of the decoder layers' projections (q, k, v, o, gate, up, down): a token's forward pass
    is about 2 FLOPs per weight, attention's own FLOPs aside."""
    q = mc.num_attention_heads * mc.head_dim
    kv = mc.num_key_value_heads * mc.head_dim
    per_layer = mc.hidden_size * (q + 2 * kv) + q * mc.hidden_size + 3 * mc.hidden_size * mc.intermediate_size
    return mc.num_hidden_layers * per_layer


def _prefill_profile(llm: Any, prompts: list[list[int]], top: int = 0, trace: str | None = None) -> str:
    """The prefill of all `prompts` added at once, as an offline run starts: each request samples one
    token and finishes, so the steps run are the prefill's. Wall time per step and the projections'
    TFLOP/s (2 x `projection_params` x prompt tokens over the wall time); on a GPU also the busy time
    the profiler saw and, with `top`, the kernels with most of it; with `trace`, the host's calls too,
    written there as a Chrome trace (`python -m pagoda.bench.trace` reads it)."""
    from torch.profiler import ProfilerActivity, profile

    from pagoda.service.sampling_params import SamplingParams

    engine = llm.engine
    device = engine.runner.device
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"prefill-{i}", prompt, params, final_only=True)
    sync(device)
    steps = 0
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if on_gpu else []
    activities += [ProfilerActivity.CPU] if trace else []
    with profile(activities=activities) if activities else nullcontext() as prof:
        start = time.perf_counter()
        while engine.has_unfinished or engine.core.has_unfinished:
            engine.step()
            steps += 1
        sync(device)
        wall = time.perf_counter() - start
    tokens = sum(map(len, prompts))
    tflops = 2 * projection_params(engine.runner.model_config) * tokens / wall / 1e12
    line = (
        f"prefill of {len(prompts)} x {len(prompts[0])} tokens: {steps} steps, {1000 * wall:.1f} ms "
        f"({1000 * wall / steps:.2f} ms/step), projections at {tflops:.1f} TFLOP/s"
    )
    if trace and prof is not None:
        prof.export_chrome_trace(trace)
    if on_gpu and prof is not None:
        kernels = device_work(prof.key_averages())
        busy_ms = sum(e.self_device_time_total for e in kernels) / 1000
        busy = f"; GPU busy {busy_ms:.1f} ms ({100 * busy_ms / (1000 * wall):.0f}%){busy_caveat(device)}"
        line = "\n".join([line + busy, *_top_kernels(kernels, steps, top)])
    return line


def busy_caveat(device: Any) -> str:
    """What a GPU-busy figure means on `device`: with programmatic dependent launch (`kernels.pdl`, on
    by default on Hopper) a kernel placed early counts as running while it waits, so busy can pass the
    wall time; `PAGODA_PDL=0` gives figures that mean busy."""
    import torch

    from pagoda.kernels import pdl

    if not pdl.flags(torch.empty(0, device=device))["PDL"]:
        return ""
    return " (PDL on: kernels waiting to start count as busy; PAGODA_PDL=0 for busy and idle)"


def device_work(events: Any) -> list[Any]:
    """The profiler's averaged events that are work on the device (kernels, copies, memsets). A
    `record_function` range shows up on the GPU's timeline as well (as `--busy-trace`'s phases do),
    spanning the kernels it launched: counting it would count those kernels twice."""
    return [e for e in events if e.self_device_time_total > 0 and not getattr(e, "is_user_annotation", False)]


def _top_kernels(kernels: list[Any], steps: int, top: int) -> list[str]:
    """The `top` profiler events with the most GPU time, as time and calls per step."""
    ranked = sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
    lines = []
    for e in ranked:
        per_step = e.self_device_time_total / steps
        lines.append(f"  {per_step:8.1f} us/step  {e.count / steps:6.1f} calls/step  {e.key[:110]}")
    return lines


def bench_transformers(args: argparse.Namespace, runner: Setup) -> list[Result]:
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from pagoda.service.model import default_model_path

    path = Path(args.model) if args.model else default_model_path()
    kwargs: dict[str, Any] = {"dtype": runner.dtype}
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model = model.to(runner.device).eval()
    vocab = runner.vocab_size
    results = []
    with torch.inference_mode():
        for batch in (1, args.num_prompts):
            ids = torch.tensor(random_prompts(batch, args.input_len, vocab), device=runner.device)
            gen = dict(
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                pad_token_id=0,
            )
            model.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, **gen)  # warm-up
            sync(runner.device)
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=args.output_len, min_new_tokens=args.output_len, **gen)
            sync(runner.device)
            seconds = time.perf_counter() - start
            decode_ms = ttft_ms = None
            if batch == 1:
                sync(runner.device)
                t0 = time.perf_counter()
                model.generate(ids, max_new_tokens=1, min_new_tokens=1, **gen)
                sync(runner.device)
                prefill = time.perf_counter() - t0
                decode_ms = 1000 * (seconds - prefill) / max(args.output_len - 1, 1)
                ttft_ms = 1000 * prefill
            results.append(
                Result("transformers generate()", batch, seconds, batch * args.output_len, decode_ms, ttft_ms)
            )
    return results


def _command(args: argparse.Namespace) -> str:
    words = ["pagoda", "bench", args.bench]
    for key, value in vars(args).items():
        if key in ("bench", "command", "_module", "output") or value is None or value is False:
            continue
        flag = f"--{key.replace('_', '-')}"
        words += [flag] if value is True else [flag, str(value)]
    # The kernels' launch switch is read from the environment: a row timed with it off says so.
    from pagoda.kernels import pdl

    return ("" if pdl.ENABLED else "PAGODA_PDL=0 ") + shlex.join(words)


def run(args: argparse.Namespace) -> int:
    if args.bench == "serve":
        from pagoda.bench import serve as bench_serve

        return bench_serve.run(args)
    if args.bench == "grammar":
        from pagoda.bench import grammar as bench_grammar

        return bench_grammar.run(args)
    if args.bench == "sampler":
        from pagoda.bench import sampler as bench_sampler

        return bench_sampler.run(args)
    if args.bench == "routing":
        from pagoda.bench import routing_sim

        return routing_sim.run(args)
    if args.bench == "spec":
        from pagoda.bench import spec as bench_spec

        return bench_spec.run(args)
    if args.bench == "lora":
        from pagoda.bench import lora as bench_lora

        return bench_lora.run(args)
    if args.bench == "kernels":
        from pagoda.bench import kernels as bench_kernels

        return bench_kernels.run(args)
    results, runner = bench_engine(args)
    if args.peer == "transformers":
        results += bench_transformers(args, runner)
    model = args.model or "SmolLM2-135M-Instruct Q4_1 GGUF (embedded)"
    precision = f"{runner.dtype}" + (f" + {args.quantization} projections" if args.quantization else "")
    precision += " + fp8 KV cache" if args.kv_cache_dtype == "fp8" else ""
    lines = [
        f"### offline: {model}, {args.input_len} in / {args.output_len} out, {precision}",
        "",
        f"Device: {device_name(runner.device)}. Command: `{_command(args)}`",
        "",
        "| system | requests | wall s | output tok/s | single-stream TTFT ms "
        "| single-stream decode ms/token | preemptions | last first token s | then ms a step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        decode = f"{r.decode_ms_per_token:.1f}" if r.decode_ms_per_token is not None else ""
        ttft = f"{r.ttft_ms:.0f}" if r.ttft_ms is not None else ""
        preempted = "" if r.preemptions is None else str(r.preemptions)
        first = "" if r.last_first_token_s is None else f"{r.last_first_token_s:.2f}"
        step = "" if r.decode_ms_per_step is None else f"{r.decode_ms_per_step:.2f}"
        lines.append(
            f"| {r.system} | {r.batch} | {r.seconds:.2f} | {r.tokens_per_second:.1f} | {ttft} | {decode} "
            f"| {preempted} | {first} | {step} |"
        )
    repeated = [r.tokens_per_second for r in results if ", run " in r.system]
    if repeated:
        lines += [
            "",
            f"{len(repeated)} runs at {args.num_prompts} requests: median {statistics.median(repeated):.1f} "
            f"output tok/s, {min(repeated):.1f}-{max(repeated):.1f}.",
        ]
    emit_markdown(lines, args.output)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m pagoda.bench ...`: the same as `pagoda bench ...` (needs no other extras)."""
    parser = argparse.ArgumentParser(prog="pagoda bench", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
