"""`pagoda bench serve` against a real `pagoda serve` process on a tiny model."""

from __future__ import annotations

import asyncio
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagoda.bench.serve import run_benchmark
from pagoda.bench.serve_processes import run_in_processes, split
from pagoda.service.serve_process import ServeProcess

MODEL = "tiny-bench"
ENV = dict(os.environ, PYTHONSAFEPATH="1")  # `python -m` from the repo root: keep operator/ off sys.path


@pytest.fixture(scope="module")
def server(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    args = [
        "--model",
        str(llama_ckpt),
        "--served-model-name",
        MODEL,
        "--kv-cache-memory-bytes",
        str(16 << 20),
    ]
    with ServeProcess(args, log_path=tmp_path_factory.mktemp("serve") / "serve.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def null_server(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """`--executor-class ...null_executor:NullExecutor` swaps only the model for a benchmark double: the
    API process and the engine core are the real ones."""
    args = ["--model", str(llama_ckpt), "--served-model-name", MODEL, "--max-num-seqs", "64"]
    args += ["--executor-class", "pagoda.service.engine.runner.null_executor:NullExecutor"]
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with ServeProcess(args, log_path=log_path) as proc:
        yield proc


def test_all_at_once_under_a_concurrency_cap(server: ServeProcess) -> None:
    summary = asyncio.run(
        run_benchmark(server.base_url, MODEL, num_prompts=8, input_len=16, output_len=6, max_concurrency=4)
    )
    assert (summary.num_ok, summary.num_failed) == (8, 0)
    assert summary.output_tokens == 8 * 6 and summary.input_tokens == 8 * 16
    assert 0 < summary.ttft_ms["median"] <= summary.latency_ms["median"]
    assert summary.itl_ms["mean"] > 0 and summary.tpot_ms["mean"] > 0
    assert 1.0 <= summary.tokens_per_chunk <= 3.0  # each chunk carries a token's text, a few at most
    assert summary.output_throughput > 0


def test_cli_at_a_request_rate_reports_failures(server: ServeProcess, tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    bench = [sys.executable, "-m", "pagoda.bench", "serve", "--base-url", server.base_url]
    common = ["--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--request-rate", "20"]
    ok = subprocess.run(
        [*bench, "--model", MODEL, *common, "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert ok.returncode == 0, ok.stderr
    assert "4 ok / 0 failed" in out.read_text() and "time to first token" in out.read_text()
    # An unknown model is refused by the server: every request fails, and so does the command.
    bad = subprocess.run(
        [*bench, "--model", "nope", *common], capture_output=True, text=True, timeout=300, env=ENV
    )
    assert bad.returncode == 1 and "0 ok / 4 failed" in bad.stdout
    assert re.search(r"- failed 4x: HTTP 404: .*nope", bad.stdout)  # why, as the server said it


def test_the_null_model_double_streams_through_the_real_server(null_server: ServeProcess) -> None:
    """Every request gets exactly its tokens, and they are ordinary text (no end of sequence, nothing
    special)."""
    summary = asyncio.run(
        run_benchmark(
            null_server.base_url, MODEL, num_prompts=48, input_len=32, output_len=40, max_concurrency=48
        )
    )
    assert (summary.num_ok, summary.num_failed) == (48, 0)
    assert summary.output_tokens == 48 * 40
    import openai

    client = openai.OpenAI(base_url=f"{null_server.base_url}/v1", api_key="none")
    done = client.completions.create(model=MODEL, prompt="Hello", max_tokens=200, temperature=0)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 200
    assert len(done.choices[0].text) > 200  # word pieces, not empty specials


def test_two_client_processes_add_up_to_one_run(null_server: ServeProcess) -> None:
    started = time.monotonic()
    summary = run_in_processes(
        2, null_server.base_url, MODEL, num_prompts=40, input_len=16, output_len=24, max_concurrency=16
    )
    wall_s = time.monotonic() - started
    assert (summary.num_ok, summary.num_failed, summary.errors) == (40, 0, {})
    assert summary.output_tokens == 40 * 24 and summary.input_tokens == 40 * 16
    # The window opens at the first request, after both interpreters started: inside the call's wall time.
    assert 0 < summary.duration_s <= wall_s
    # No check on ITL: a loaded server may merge a stream's tokens into one chunk, leaving no gap to time.
    assert 0 < summary.ttft_ms["median"] <= summary.latency_ms["median"]


def test_cli_with_two_client_processes_at_a_request_rate(null_server: ServeProcess) -> None:
    bench = [sys.executable, "-m", "pagoda.bench", "serve", "--base-url", null_server.base_url]
    common = ["--model", MODEL, "--num-prompts", "6", "--input-len", "8", "--output-len", "4"]
    done = subprocess.run(
        [*bench, *common, "--request-rate", "30", "--client-processes", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert done.returncode == 0, done.stderr
    assert "6 ok / 0 failed, 30 req/s (Poisson), max concurrency 6 from 2 client processes" in done.stdout


def test_the_split_deals_prompts_concurrency_and_rate() -> None:
    prompts = [[i] for i in range(7)]
    jobs = split(3, "http://x", MODEL, prompts, 4, 30.0, 8, random.Random(0))
    assert [job.prompts for job in jobs] == [[[0], [3], [6]], [[1], [4]], [[2], [5]]]
    assert [job.max_concurrency for job in jobs] == [3, 3, 2]
    assert {job.request_rate for job in jobs} == {10.0} and len({job.seed for job in jobs}) == 3
    with pytest.raises(ValueError, match="--client-processes 3"):
        split(3, "http://x", MODEL, prompts, 4, 30.0, 2, random.Random(0))  # a process with no slot


@pytest.mark.parametrize(
    ("fraction", "picked"),
    [(0.0, []), (0.25, [3, 7]), (0.5, [1, 3, 5, 7]), (1 / 3, [2, 5]), (1.0, list(range(8)))],
)
def test_the_structured_fraction_spreads_the_constrained_requests(fraction: float, picked: list[int]) -> None:
    from pagoda.bench.serve import is_constrained

    assert [i for i in range(8) if is_constrained(i, fraction)] == picked


def test_constrained_and_free_requests_are_reported_apart(server: ServeProcess, tmp_path: Path) -> None:
    """Half the requests carry the schema: the server takes them (a bad body would fail them), and the
    report has a row for each kind with its own figures."""
    summary = asyncio.run(
        run_benchmark(
            server.base_url, MODEL, num_prompts=4, input_len=8, output_len=6, structured_fraction=0.5
        )
    )
    assert (summary.num_ok, summary.num_failed) == (4, 0)
    assert {name: kind.num_ok for name, kind in summary.kinds.items()} == {
        "constrained": 2,
        "unconstrained": 2,
    }
    assert summary.kinds["unconstrained"].output_tokens == 2 * 6
    assert summary.output_tokens == sum(kind.output_tokens for kind in summary.kinds.values())
    out = tmp_path / "bench.md"
    bench = [sys.executable, "-m", "pagoda.bench", "serve", "--base-url", server.base_url]
    done = subprocess.run(
        [*bench, "--model", MODEL, "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
         "--structured-fraction", "0.5", "--output", str(out)],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    kinds = ("| constrained", "| unconstrained")
    rows = [line for line in out.read_text().splitlines() if line.startswith(kinds)]
    assert [row.split(" | ")[:2] for row in rows] == [["| constrained", "1"], ["| unconstrained", "1"]]
    assert "Constrained / unconstrained time per output token (median): " in out.read_text()
    refused = subprocess.run(
        [*bench, "--model", MODEL, "--structured-fraction", "1.5"], capture_output=True, text=True, env=ENV
    )
    assert refused.returncode == 2 and "expected a fraction from 0 to 1, got '1.5'" in refused.stderr
