"""`pagoda bench soak`: a server under overload for a long time, the way production treats it.

First it finds the saturating request rate (a closed loop at high concurrency, the same request mix),
then it sends Poisson arrivals at `--overload` times that rate for `--duration` seconds. The mix: streamed
completions of mixed prompt and output lengths, a share of clients that disconnect mid-stream, and a
share of hostile requests (bad fields, broken JSON, lone surrogates, an oversized body). Every
`--sample-every` seconds it records the server's RSS (its whole process tree, from /proc), GPU memory and
queue gauges (from /metrics). It reports the 5xx count (503 backpressure is counted apart: it is the
intended answer to overload), RSS and GPU memory over time, KV usage once idle, and p50/p99 latencies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagoda.bench.serve import _stats_ms

if TYPE_CHECKING:
    import httpx

INPUT_LENS = (32, 128, 512, 2048)
OUTPUT_LENS = (16, 64, 256)


def hostile_bodies(model: str) -> list[bytes]:
    """Requests a server must refuse with a 4xx and survive."""
    ok = {"model": model, "prompt": "Hello", "max_tokens": 4}
    bad_fields: list[dict[str, Any]] = [
        {"top_k": 10**19},  # allowed: clamped to off
        {"stop_token_ids": [-100000], "min_tokens": 2},
        {"n": 10**12},
        {"seed": 2**70},
        {"logprobs": 10**6},
        {"stop": ["x"] * 1000},
        {"prompt": [10**30]},
        {"prompt": "a\ud800b"},
        {"max_tokens": "many"},
        {"min_tokens": 10**12, "max_tokens": None},
    ]
    bodies = [json.dumps({**ok, **f}, ensure_ascii=True).encode() for f in bad_fields]
    bodies.append(b'{"model": "' + model.encode() + b'", "prompt": "Hi", "temperature": NaN}')
    bodies.append(b'{"prompt": ')
    bodies.append(json.dumps({**ok, "prompt": "word " * (4 << 20)}).encode())  # 20 MB: over the body limit
    return bodies


@dataclass
class Tally:
    status: Counter[str] = field(default_factory=Counter)  # "200", "503", "disconnected", "error:..."
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    completed: int = 0
    server_errors: list[str] = field(default_factory=list)


async def _stream(
    client: httpx.AsyncClient, body: dict[str, Any], tally: Tally, disconnect_after: int | None
) -> None:
    start = time.perf_counter()
    first = 0.0
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread())[:300].decode(errors="replace")
                tally.status[str(response.status_code)] += 1
                if response.status_code >= 500 and response.status_code != 503:
                    tally.server_errors.append(f"{response.status_code}: {text}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    tally.status["stream-error"] += 1
                    tally.server_errors.append(f"in-stream: {chunk['error']}")
                    return
                if chunk.get("usage"):
                    tally.output_tokens += chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    chunks += 1
                    if not first:
                        first = time.perf_counter() - start
                    if disconnect_after is not None and chunks >= disconnect_after:
                        tally.status["disconnected"] += 1
                        return  # leaving the block closes the connection mid-stream
    except Exception as exc:
        tally.status[f"error:{type(exc).__name__}"] += 1
        tally.server_errors.append(f"{type(exc).__name__}: {exc}")
        return
    tally.status["200"] += 1
    tally.completed += 1
    tally.ttft_s.append(first)
    tally.latency_s.append(time.perf_counter() - start)


async def _hostile(client: httpx.AsyncClient, body: bytes, tally: Tally) -> None:
    try:
        response = await client.post(
            "/v1/completions", content=body, headers={"Content-Type": "application/json"}
        )
    except Exception as exc:
        tally.status[f"hostile-error:{type(exc).__name__}"] += 1
        tally.server_errors.append(f"hostile: {type(exc).__name__}: {exc}")
        return
    tally.status[f"hostile-{response.status_code}"] += 1
    if response.status_code >= 500:
        tally.server_errors.append(f"hostile {response.status_code}: {response.text[:300]}")


def _request(rng: random.Random, model: str, vocab_size: int) -> dict[str, Any]:
    input_len, output_len = rng.choice(INPUT_LENS), rng.choice(OUTPUT_LENS)
    return {
        "model": model,
        "prompt": [rng.randrange(100, vocab_size - 100) for _ in range(input_len)],
        "max_tokens": output_len,
        "temperature": rng.choice((0.0, 0.8)),
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def tree_rss_bytes(pid: int) -> int:
    """RSS of `pid` and all its descendants (API process, engine core, workers), from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    total = 0
    for p in tree:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def _gauge(metrics: str, name: str) -> float:
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M)]
    return sum(values)


async def _sample(
    client: httpx.AsyncClient, server_pid: int | None, start: float, samples: list[dict[str, float]]
) -> None:
    try:
        metrics = (await client.get("/metrics")).text
    except Exception:
        metrics = ""
    samples.append(
        {
            "t_s": time.perf_counter() - start,
            "rss_gib": tree_rss_bytes(server_pid) / 2**30 if server_pid else 0.0,
            "gpu_mem_gib": _gauge(metrics, "pagoda_gpu_memory_used_bytes") / 2**30,
            "waiting": _gauge(metrics, "pagoda_requests_waiting"),
            "running": _gauge(metrics, "pagoda_requests_running"),
            "kv_usage": _gauge(metrics, "pagoda_kv_cache_usage_ratio"),
        }
    )


async def saturating_rate(
    base_url: str, model: str, vocab_size: int, concurrency: int, seconds: float
) -> float:
    """Completed requests per second of the mix in a closed loop of `concurrency` clients."""
    import httpx

    rng = random.Random(1)
    tally = Tally()
    limits = httpx.Limits(max_connections=concurrency + 8)
    deadline = time.perf_counter() + seconds
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None), limits=limits) as client:

        async def loop() -> None:
            while time.perf_counter() < deadline:
                await _stream(client, _request(rng, model, vocab_size), tally, None)

        start = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return tally.completed / (time.perf_counter() - start)


async def soak(
    args: argparse.Namespace, rate: float
) -> tuple[Tally, list[dict[str, float]], dict[str, float]]:
    import httpx

    rng = random.Random(0)
    tally = Tally()
    samples: list[dict[str, float]] = []
    hostile = hostile_bodies(args.model)
    limits = httpx.Limits(max_connections=4096)
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=timeout, limits=limits) as client:
        start = time.perf_counter()
        next_sample = start
        tasks: set[asyncio.Task[None]] = set()
        while (now := time.perf_counter()) - start < args.duration:
            if now >= next_sample:
                await _sample(client, args.server_pid, start, samples)
                next_sample += args.sample_every
            draw = rng.random()
            if draw < args.hostile_fraction:
                task = asyncio.create_task(_hostile(client, rng.choice(hostile), tally))
            else:
                cut = rng.randint(1, 8) if rng.random() < args.disconnect_fraction else None
                task = asyncio.create_task(
                    _stream(client, _request(rng, args.model, args.vocab_size), tally, cut)
                )
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        # Idle again: every KV block must be free, the queue empty.
        await asyncio.sleep(2.0)
        await _sample(client, args.server_pid, start, samples)
        end = samples[-1]
    return tally, samples, end


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of overload")
    parser.add_argument("--overload", type=float, default=2.0, help="times the saturating rate")
    parser.add_argument("--request-rate", type=float, default=None, help="skip the saturation run")
    parser.add_argument("--saturation-seconds", type=float, default=60.0)
    parser.add_argument("--saturation-concurrency", type=int, default=256)
    parser.add_argument("--disconnect-fraction", type=float, default=0.1)
    parser.add_argument("--hostile-fraction", type=float, default=0.05)
    parser.add_argument("--sample-every", type=float, default=30.0)
    parser.add_argument("--server-pid", type=int, default=None, help="RSS of this process tree is sampled")
    parser.add_argument("--output", default=None, help="append the Markdown report to this file")


def report(
    args: argparse.Namespace, saturating: float, rate: float, tally: Tally, samples: list[dict[str, float]]
) -> str:
    ttft, latency = _stats_ms(tally.ttft_s), _stats_ms(tally.latency_s)
    five_xx = sum(n for code, n in tally.status.items() if code.startswith("5") and code != "503")
    five_xx += sum(n for code, n in tally.status.items() if code.startswith("hostile-5"))
    lines = [
        f"### soak: {args.model}, {args.duration:.0f} s at {rate:.1f} req/s "
        f"({args.overload:g}x the saturating {saturating:.1f} req/s)",
        "",
        f"5xx other than 503: **{five_xx}**; outcomes: "
        + ", ".join(f"{code} {n}" for code, n in sorted(tally.status.items())),
        f"completed streams: {tally.completed}, output tokens {tally.output_tokens} "
        f"({tally.output_tokens / args.duration:.0f} tok/s); "
        f"TTFT p50 {ttft['median']:.0f} ms, p99 {ttft['p99']:.0f} ms; "
        f"end-to-end p50 {latency['median']:.0f} ms, p99 {latency['p99']:.0f} ms",
        "",
        "| t (s) | server RSS (GiB) | GPU memory (GiB) | waiting | running | KV usage |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in samples:
        lines.append(
            f"| {s['t_s']:.0f} | {s['rss_gib']:.2f} | {s['gpu_mem_gib']:.1f} | {s['waiting']:.0f} "
            f"| {s['running']:.0f} | {s['kv_usage']:.3f} |"
        )
    lines += ["", f"Idle at the end: KV usage {samples[-1]['kv_usage']:.3f} (0 means every block is free)."]
    if tally.server_errors:
        lines += ["", "First server errors:", *[f"- {e}" for e in tally.server_errors[:5]]]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    saturating = args.request_rate / args.overload if args.request_rate else 0.0
    if not args.request_rate:
        saturating = asyncio.run(
            saturating_rate(
                args.base_url,
                args.model,
                args.vocab_size,
                args.saturation_concurrency,
                args.saturation_seconds,
            )
        )
        print(f"saturating rate: {saturating:.2f} req/s", flush=True)
    rate = args.request_rate or args.overload * saturating
    tally, samples, end = asyncio.run(soak(args, rate))
    text = report(args, saturating, rate, tally, samples)
    print(text)
    if args.output:
        with open(args.output, "a") as f:
            f.write("\n" + text)
    five_xx = [e for e in tally.server_errors if not e.startswith("503")]
    return 0 if not five_xx and end["kv_usage"] == 0.0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(prog="pagoda bench soak", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
