"""`pagoda bench serve`: load a running OpenAI-compatible server the way users do, and measure it.

In the spirit of `vllm bench serve`: N requests of random token ids (exact input lengths, `ignore_eos`
so every request produces exactly the output length) are sent as streamed `/v1/completions`, either
all at once under a concurrency cap or arriving as a Poisson process at `--request-rate`. Per request
it records the time to first token (TTFT), the gaps between streamed chunks (inter-token latency,
ITL) and the end-to-end latency; it reports throughput and the mean / median / p99 of each. Any
OpenAI-compatible server can be the target, so a peer (vLLM, NIM) is measured with the same tool.
One client process parses only so many chunks a second; `--client-processes` splits the load over
several (`bench_serve_processes`). `--structured-fraction F` gives that share of the requests a small
strict JSON Schema (`response_format`), sent among the free ones, and reports each kind apart:
structured output's cost measured against unconstrained requests of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when the benchmark runs: `pagoda --help` must not need it
    import httpx


# The constrained requests' schema (`--structured-fraction`): three properties, as a typical tool or
# extraction schema has. With `ignore_eos` a request still ends where its object does.
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@dataclass
class RequestResult:
    ok: bool
    constrained: bool = False  # sent with `SCHEMA` as its response_format
    # On time.monotonic, one clock for every process on the machine (perf_counter's reference point
    # is per process): results from several client processes share one timeline.
    start_s: float = 0.0
    end_s: float = 0.0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text_chunks: int = 0  # streamed chunks that carried text; fewer than the tokens when deltas bunch
    error: str = ""


@dataclass
class Summary:
    num_ok: int
    num_failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    tpot_ms: dict[str, float]  # per request: (latency - TTFT) / (output tokens - 1)
    latency_ms: dict[str, float]
    # Output tokens / chunks with text: above 1, an ITL gap spans several tokens.
    tokens_per_chunk: float = 1.0
    errors: dict[str, int] = field(default_factory=dict)  # why requests failed -> how many, most first
    # With some requests constrained: "constrained" and "unconstrained", each summarized alone.
    kinds: dict[str, Summary] = field(default_factory=dict)

    @property
    def request_throughput(self) -> float:
        return self.num_ok / self.duration_s

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "mean": 1000 * statistics.fmean(values),
        "median": 1000 * statistics.median(values),
        "p99": 1000 * p99,
    }


def is_constrained(index: int, fraction: float) -> bool:
    """Whether request `index` carries the schema: `fraction` of them, spread evenly through the run."""
    return math.floor((index + 1) * fraction) > math.floor(index * fraction)


async def _one(
    client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int, constrained: bool = False
) -> RequestResult:
    body: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if constrained:
        schema = {"name": "person", "schema": SCHEMA, "strict": True}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    result = RequestResult(ok=False, constrained=constrained, start_s=time.monotonic())
    try:
        await _stream(client, body, result)
    except Exception as exc:  # a refused or broken connection counts as a failed request
        cause = exc.__cause__ or exc.__context__
        result.error = f"{type(exc).__name__}: {exc}"
        result.error += f" ({type(cause).__name__}: {cause})" if cause else ""
        result.error += f" after {len(result.itl_s) + bool(result.ttft_s)} chunks"
    result.end_s = time.monotonic()
    result.latency_s = result.end_s - result.start_s
    result.ok = not result.error and result.output_tokens > 0
    return result


async def _stream(client: httpx.AsyncClient, body: dict[str, object], result: RequestResult) -> None:
    last = result.start_s
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                continue
            now = time.monotonic()
            result.text_chunks += 1
            if result.ttft_s == 0.0:
                result.ttft_s = now - result.start_s
            else:
                result.itl_s.append(now - last)
            last = now


def make_prompts(rng: random.Random, num_prompts: int, input_len: int, vocab_size: int) -> list[list[int]]:
    return [[rng.randrange(100, vocab_size - 100) for _ in range(input_len)] for _ in range(num_prompts)]


async def send_requests(
    base_url: str,
    model: str,
    prompts: list[list[int]],
    output_len: int,
    request_rate: float,
    max_concurrency: int | None,
    rng: random.Random,
    structured_fraction: float = 0.0,
) -> list[RequestResult]:
    """Every prompt as one streamed completion, under the cap; `rng` draws the Poisson arrivals."""
    import httpx

    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    timeout = httpx.Timeout(None, connect=30.0)
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts))
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:

        async def limited(prompt: list[int], constrained: bool) -> RequestResult:
            async with limit:
                return await _one(client, model, prompt, output_len, constrained)

        tasks = []
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.create_task(limited(prompt, is_constrained(i, structured_fraction))))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        return await asyncio.gather(*tasks)


def summarize(results: list[RequestResult], input_len: int) -> Summary:
    """The run lasts from the first request's start to the last one's end, whichever process sent them."""
    ok = [r for r in results if r.ok]
    kinds = {}
    if any(r.constrained for r in results) and not all(r.constrained for r in results):
        for name, constrained in (("constrained", True), ("unconstrained", False)):
            kinds[name] = summarize([r for r in results if r.constrained is constrained], input_len)
    return Summary(
        num_ok=len(ok),
        num_failed=len(results) - len(ok),
        duration_s=max(r.end_s for r in results) - min(r.start_s for r in results),
        input_tokens=input_len * len(ok),
        output_tokens=sum(r.output_tokens for r in ok),
        ttft_ms=_stats_ms([r.ttft_s for r in ok]),
        itl_ms=_stats_ms([gap for r in ok for gap in r.itl_s]),
        tpot_ms=_stats_ms(
            [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        ),
        latency_ms=_stats_ms([r.latency_s for r in ok]),
        tokens_per_chunk=sum(r.output_tokens for r in ok) / max(1, sum(r.text_chunks for r in ok)),
        errors=dict(Counter(r.error or "no tokens" for r in results if not r.ok).most_common()),
        kinds=kinds,
    )


async def run_benchmark(
    base_url: str,
    model: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
    vocab_size: int = 32000,
    seed: int = 0,
    structured_fraction: float = 0.0,
) -> Summary:
    rng = random.Random(seed)
    prompts = make_prompts(rng, num_prompts, input_len, vocab_size)
    results = await send_requests(
        base_url, model, prompts, output_len, request_rate, max_concurrency, rng, structured_fraction
    )
    return summarize(results, input_len)


def auto_client_processes(concurrency: int) -> int:
    """One process per 32 in-flight requests, one per CPU at most. Measured against a server doing no
    model work: one process at 256 tops out at 7.7k output tok/s, two at 128 each reached 14.5k; on the
    H200, one process at c=64 (7k tok/s) added its own 19 ms inter-token p99 while no step took 15 ms."""
    return min(os.cpu_count() or 1, math.ceil(concurrency / 32))


def _client_processes(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a count of at least 1 or 'auto', got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server to load")
    parser.add_argument("--model", required=True, help="the served model name (GET /v1/models)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once"
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="in-flight requests at most")
    parser.add_argument(
        "--client-processes",
        type=_client_processes,
        default=1,
        help="send from this many processes, each with its share of the prompts, of the concurrency and "
        "of the request rate (N Poisson processes at rate/N are one at rate); one process parses ~7.7k "
        "output tok/s at most on the H200 machine. auto: one per 32 in-flight requests, one per CPU at most",
    )
    parser.add_argument("--vocab-size", type=int, default=32000, help="prompt token ids are drawn below this")
    parser.add_argument(
        "--structured-fraction",
        type=_fraction,
        default=0.0,
        help="this share of the requests (0 to 1) asks for a small strict JSON Schema (response_format), "
        "spread among the others; each kind is then reported apart",
    )
    parser.add_argument("--output", default=None, help="append the Markdown result to this file")


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction from 0 to 1, got {text!r}")
    return value


def format_summary(args: argparse.Namespace, summary: Summary, num_processes: int = 1) -> str:
    def row(name: str, stats: dict[str, float]) -> str:
        return f"| {name} | {stats['mean']:.1f} | {stats['median']:.1f} | {stats['p99']:.1f} |"

    rate = "all at once" if args.request_rate == float("inf") else f"{args.request_rate:g} req/s (Poisson)"
    clients = f" from {num_processes} client processes" if num_processes > 1 else ""
    return "\n".join(
        [
            f"### serve: {args.model} at {args.base_url}, {args.input_len} in / {args.output_len} out",
            "",
            f"{summary.num_ok} ok / {summary.num_failed} failed, {rate}, max concurrency "
            f"{args.max_concurrency or args.num_prompts}{clients}: {summary.duration_s:.2f} s, "
            f"{summary.request_throughput:.2f} req/s, {summary.output_throughput:.1f} output tok/s",
            "",
            "| latency (ms) | mean | median | p99 |",
            "| --- | ---: | ---: | ---: |",
            row("time to first token", summary.ttft_ms),
            row("time per output token", summary.tpot_ms),
            row("inter-token latency", summary.itl_ms),
            row("end to end", summary.latency_ms),
            "",
            f"Output tokens per streamed text chunk: {summary.tokens_per_chunk:.2f}.",
            "",
            *(f"- failed {n}x: {error}" for error, n in list(summary.errors.items())[:5]),
            *([""] if summary.errors else []),
            *_format_kinds(summary),
        ]
    )


def _format_kinds(summary: Summary) -> list[str]:
    """Constrained against unconstrained requests of the same run (`--structured-fraction`)."""
    if not summary.kinds:
        return []
    lines = [
        "| requests | ok | output tokens | TTFT median | TTFT p99 | TPOT median | TPOT p99 | ITL median "
        "| ITL p99 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, kind in summary.kinds.items():
        lines.append(
            f"| {name} | {kind.num_ok} | {kind.output_tokens} | {kind.ttft_ms['median']:.1f} "
            f"| {kind.ttft_ms['p99']:.1f} | {kind.tpot_ms['median']:.2f} | {kind.tpot_ms['p99']:.2f} "
            f"| {kind.itl_ms['median']:.2f} | {kind.itl_ms['p99']:.2f} |"
        )
    free = summary.kinds["unconstrained"].tpot_ms["median"]
    bound = summary.kinds["constrained"].tpot_ms["median"]
    ratio = f"{bound / free:.2f}x" if free else "n/a"
    return [*lines, "", f"Constrained / unconstrained time per output token (median): {ratio}.", ""]


def run(args: argparse.Namespace) -> int:
    num_processes = args.client_processes
    if num_processes == "auto":
        num_processes = auto_client_processes(min(args.max_concurrency or args.num_prompts, args.num_prompts))
    load = (args.base_url, args.model, args.num_prompts, args.input_len, args.output_len)
    shape = (args.request_rate, args.max_concurrency, args.vocab_size, 0, args.structured_fraction)
    if num_processes == 1:
        summary = asyncio.run(run_benchmark(*load, *shape))
    else:
        from pagoda.bench.serve_processes import run_in_processes

        summary = run_in_processes(num_processes, *load, *shape)
    text = format_summary(args, summary, num_processes)
    print(text)
    if args.output:
        with open(args.output, "a") as f:
            f.write("\n" + text)
    return 0 if summary.num_failed == 0 else 1
