"""`pagoda bench serve --client-processes N`: the same requests, sent from N processes.

One asyncio process parsing streamed chunks is the bottleneck first: against a server doing no model
work it topped out at 7.7k output tok/s with 256 in flight, where two processes at 128 each reached
14.5k together. Here the prompts are dealt round robin to N spawned processes, each with its own
event loop and httpx client, its share of the concurrency cap and of the request rate (N Poisson
processes at rate/N add up to one at rate). They start together at a barrier, once the interpreters
are up and httpx is imported; each request comes back with its start and end on time.monotonic,
which every process on the machine shares, so `summarize` sees one run as if one process sent it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import threading
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import httpx  # noqa: F401  (imported by each client process before the barrier, not in the timed window)

from pagoda.bench.serve import RequestResult, Summary, make_prompts, send_requests, summarize

_READY_TIMEOUT_S = 120.0  # for N interpreters to start and import on a busy machine


@dataclass(frozen=True)
class ClientJob:
    """One process's share of the run."""

    base_url: str
    model: str
    prompts: list[list[int]]
    output_len: int
    request_rate: float
    max_concurrency: int
    seed: int  # of its Poisson arrivals
    structured_fraction: float = 0.0


def split(
    num_processes: int,
    base_url: str,
    model: str,
    prompts: list[list[int]],
    output_len: int,
    request_rate: float,
    max_concurrency: int | None,
    rng: random.Random,
    structured_fraction: float = 0.0,
) -> list[ClientJob]:
    concurrency = max_concurrency or len(prompts)
    if not 1 <= num_processes <= min(concurrency, len(prompts)):
        raise ValueError(
            f"--client-processes {num_processes}: each process needs a prompt and a concurrency of at "
            f"least 1 ({len(prompts)} prompts, max concurrency {concurrency})"
        )
    return [
        ClientJob(
            base_url,
            model,
            prompts[i::num_processes],
            output_len,
            request_rate / num_processes,
            concurrency // num_processes + (i < concurrency % num_processes),
            rng.randrange(2**32),
            structured_fraction,
        )
        for i in range(num_processes)
    ]


def _send(job: ClientJob, barrier: threading.Barrier) -> list[RequestResult]:
    barrier.wait(_READY_TIMEOUT_S)
    return asyncio.run(
        send_requests(
            job.base_url,
            job.model,
            job.prompts,
            job.output_len,
            job.request_rate,
            job.max_concurrency,
            random.Random(job.seed),
            job.structured_fraction,
        )
    )


def run_in_processes(
    num_processes: int,
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
    """`run_benchmark`'s prompts and summary, the requests sent from `num_processes` processes."""
    rng = random.Random(seed)
    prompts = make_prompts(rng, num_prompts, input_len, vocab_size)
    jobs = split(
        num_processes, base_url, model, prompts, output_len, request_rate, max_concurrency, rng,
        structured_fraction,
    )  # fmt: skip
    # spawn: a fresh interpreter, not a fork of a caller that may hold threads or an event loop.
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, ProcessPoolExecutor(num_processes, mp_context=context) as pool:
        barrier = manager.Barrier(num_processes)
        parts = pool.map(_send, jobs, [barrier] * num_processes)
        results = [result for part in parts for result in part]
    return summarize(results, input_len)
