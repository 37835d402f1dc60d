"""`pagoda bench serve` against a real `pagoda serve` process on a tiny model."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagoda.service.bench_serve import run_benchmark
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


def test_all_at_once_under_a_concurrency_cap(server: ServeProcess) -> None:
    summary = asyncio.run(
        run_benchmark(server.base_url, MODEL, num_prompts=8, input_len=16, output_len=6, max_concurrency=4)
    )
    assert (summary.num_ok, summary.num_failed) == (8, 0)
    assert summary.output_tokens == 8 * 6 and summary.input_tokens == 8 * 16
    assert 0 < summary.ttft_ms["median"] <= summary.latency_ms["median"]
    assert summary.itl_ms["mean"] > 0 and summary.tpot_ms["mean"] > 0
    assert summary.output_throughput > 0


def test_cli_at_a_request_rate_reports_failures(server: ServeProcess, tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    bench = [sys.executable, "-m", "pagoda.service.bench", "serve", "--base-url", server.base_url]
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


def test_the_null_model_double_streams_through_the_real_server(llama_ckpt: Path, tmp_path: Path) -> None:
    """`PAGODA_BENCH_NULL_MODEL=1` swaps only the model for `null_executor` (a benchmark double): the
    API process and the engine core are the real ones, every request gets exactly its tokens, and
    they are ordinary text (no end of sequence, nothing special)."""
    args = ["--model", str(llama_ckpt), "--served-model-name", MODEL, "--max-num-seqs", "64"]
    with ServeProcess(args, log_path=tmp_path / "serve.log", env={"PAGODA_BENCH_NULL_MODEL": "1"}) as proc:
        summary = asyncio.run(
            run_benchmark(
                proc.base_url, MODEL, num_prompts=48, input_len=32, output_len=40, max_concurrency=48
            )
        )
        assert (summary.num_ok, summary.num_failed) == (48, 0)
        assert summary.output_tokens == 48 * 40
        import openai

        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="none")
        done = client.completions.create(model=MODEL, prompt="Hello", max_tokens=200, temperature=0)
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 200
        assert len(done.choices[0].text) > 200  # word pieces, not empty specials
