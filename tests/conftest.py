"""Shared fixtures: tiny random-weight Hugging Face checkpoints built with transformers.

Each checkpoint folder has `config.json`, `*.safetensors`, `generation_config.json`,
`tokenizer.json` and `tokenizer_config.json` (SmolLM2's byte-level BPE, 49152 tokens, with its chat
template), so it loads exactly like a real one. Hidden size 64 keeps each model a few MB.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Every process the tests start (servers, engine cores, workers, transformers in a subprocess) gets one
# OpenMP thread too: with xdist's workers on both cores, a server's second thread made its forward
# passes up to 60x slower (tests/test_structured_output.py: 168 s with two threads, 22 s with one, beside
# a busy core). The engine leaves a set OMP_NUM_THREADS alone (service/engine/runner/cpu_threads.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _one_torch_thread() -> None:
    """One intra-op thread wherever a test uses torch: on a shared 2-core machine OpenMP threads that
    wait for a descheduled peer make small ops 100x slower, and a fixed thread count keeps float
    reductions in one order, so the engine-vs-transformers comparisons are reproducible. Only once
    torch is imported: pytest's start-up imports no torch (2-3 s), so the torch-free tests start fast."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


class _IsolatedSteps(logging.Handler):
    """Collects the engine core's `ISOLATED_STEP_WARNING` records."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        from pagoda.service.engine.core.engine_core import ISOLATED_STEP_WARNING

        if record.msg == ISOLATED_STEP_WARNING:
            self.messages.append(record.getMessage())


_SERVERS: list[Any] = []  # every `ServeProcess` this process launched: the fixture below reads their logs


def _register_servers() -> None:
    from pagoda.service.serve_process import ServeProcess

    launch = ServeProcess.launch

    def launch_registered(self: ServeProcess) -> ServeProcess:
        _SERVERS.append(self)
        return launch(self)

    ServeProcess.launch = launch_registered  # type: ignore[method-assign]


_register_servers()


def _log_sizes() -> dict[int, int]:
    return {id(s): s.log_path.stat().st_size if s.log_path.exists() else 0 for s in _SERVERS}


def _isolated_in_server_logs(since: dict[int, int]) -> list[str]:
    """The isolated-step warnings the servers logged past `since` (their log sizes then)."""
    if not _SERVERS:
        return []
    from pagoda.service.engine.core.engine_core import ISOLATED_STEP_WARNING

    tail = ISOLATED_STEP_WARNING.rpartition("; ")[2]  # "running them one by one", after the formatted part
    found = []
    for server in _SERVERS:
        if not server.log_path.exists():
            continue
        with open(server.log_path, "rb") as log:
            log.seek(since.get(id(server), 0))
            found += [line for line in log.read().decode(errors="replace").splitlines() if tail in line]
    return found


@pytest.fixture(autouse=True)
def _steps_do_not_fail_quietly(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test in which an engine step raised, unless it is marked `steps_may_fail`: in this process
    (the engine core's logger) or in a `pagoda serve` it launched (the part of its log written during
    the test). The core re-runs such a step one sequence at a time (`_execute_isolated`), which gives the
    right tokens whenever the one-sequence path works: a batch path that raises would pass every test
    that only compares outputs. (Engines in pods or other launchers are not watched.)"""
    watch = _IsolatedSteps()
    core_logger = logging.getLogger("pagoda.service.engine.core.engine_core")
    core_logger.addHandler(watch)
    since = _log_sizes()
    try:
        yield
    finally:
        core_logger.removeHandler(watch)
    found = watch.messages + _isolated_in_server_logs(since)
    if found and request.node.get_closest_marker("steps_may_fail") is None:
        pytest.fail(
            "an engine step raised and was re-run one sequence at a time (mark the test steps_may_fail "
            "if it raises on purpose): " + "; ".join(found[:3])
        )


VOCAB_SIZE = 49152  # SmolLM2's tokenizer
BOS_ID, EOS_ID = 1, 2
_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    # Wider than the default 0.02 so random logits are decisive and greedy choices are not near-ties.
    initializer_range=0.1,
)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from pagoda.service.model import default_model_path

    return default_model_path()  # `make setup` installs it; its absence is a failure, not a skip


def shared_folder(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Any]) -> Path:
    """The folder `name`, made by `make(folder)` once per test run: under xdist the first worker to ask
    makes it while the others wait on a lock, and every worker reads that one copy (a worker's own tmp
    folder would make it once per worker: 3-5 s of transformers each). Readers must not change it."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent  # the run's folder, above each worker's popen-gwN
    folder = root / "shared" / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if not folder.is_dir():
            partial = folder.with_name(f"{name}.partial")
            shutil.rmtree(partial, ignore_errors=True)
            make(partial)
            partial.rename(folder)
    return folder


@pytest.fixture(scope="session")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Path:
    """A folder with SmolLM2's `tokenizer.json` and `tokenizer_config.json`, rebuilt from the GGUF."""
    from pagoda.service.model import write_default_tokenizer

    return shared_folder(tmp_path_factory, "tokenizer", lambda f: write_default_tokenizer(f, smollm2_gguf))


@pytest.fixture(scope="session")
def smollm2_transformers(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Path:
    """transformers' own reading of the embedded GGUF (its dequantization, its inverse q/k permutation),
    saved once as a float32 checkpoint folder: reading the GGUF takes transformers ~15 s, this ~1 s."""

    def make(folder: Path) -> None:
        import torch
        from safetensors.torch import save_model
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
        )
        # save_pretrained refuses a model read from a GGUF ("quantized with gguf"): its weights are
        # plain float32 by now, so they and the config without the quantization entry are saved as is.
        folder.mkdir()
        save_model(model, str(folder / "model.safetensors"))
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        type(model.config).from_dict(config).save_pretrained(folder)

    return shared_folder(tmp_path_factory, "smollm2_transformers", make)


def _build(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    tokenizer_files: Path,
    config: Any,
    max_shard_size: str | None = None,
    seed: int = 0,
) -> Path:
    """A random-weight checkpoint folder, made once per test run (`shared_folder`)."""

    def make(folder: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(folder, **kwargs)
        GenerationConfig(bos_token_id=BOS_ID, eos_token_id=[EOS_ID], do_sample=False).save_pretrained(folder)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_files / file, folder / file)

    return shared_folder(tmp_path_factory, name, make)


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory: pytest.TempPathFactory, tokenizer_files: Path) -> Path:
    """Llama 3.1 shape: GQA (4 query heads, 2 KV heads), llama3 rope scaling, untied embeddings."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        **_COMMON,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        tie_word_embeddings=False,
    )
    return _build(tmp_path_factory, "llama", tokenizer_files, config, seed=1)


@pytest.fixture(scope="session")
def qwen2_ckpt(tmp_path_factory: pytest.TempPathFactory, tokenizer_files: Path) -> Path:
    """Qwen2: bias on q/k/v, GQA."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        **_COMMON,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    )
    return _build(tmp_path_factory, "qwen2", tokenizer_files, config, seed=2)


@pytest.fixture(scope="session")
def tied_llama_ckpt(tmp_path_factory: pytest.TempPathFactory, tokenizer_files: Path) -> Path:
    """Tied embeddings (no lm_head in the file), plain rope, and head_dim 32 != hidden / heads."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        **_COMMON,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        tie_word_embeddings=True,
    )
    return _build(tmp_path_factory, "tied_llama", tokenizer_files, config, seed=3)


@pytest.fixture(scope="session")
def sharded_llama_ckpt(tmp_path_factory: pytest.TempPathFactory, tokenizer_files: Path) -> Path:
    """Mistral-style Llama in several safetensors shards with an index; linear rope scaling."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        **_COMMON,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        tie_word_embeddings=False,
    )
    return _build(tmp_path_factory, "sharded_llama", tokenizer_files, config, max_shard_size="1MB", seed=4)


@pytest.fixture(scope="session")
def mistral_ckpt(tmp_path_factory: pytest.TempPathFactory, tokenizer_files: Path) -> Path:
    """MistralForCausalLM: GQA, no sliding window within the tested lengths."""
    from transformers import MistralConfig

    config = MistralConfig(
        **_COMMON,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=None,
        tie_word_embeddings=False,
    )
    return _build(tmp_path_factory, "mistral", tokenizer_files, config, seed=5)


_BLOCK_SIZE = 4  # small, so a prompt spans several blocks


class PagedRunner:
    """A minimal model runner: one block table per sequence, blocks handed out in order."""

    def __init__(
        self, model: Any, num_blocks: int = 64, cache_dtype: Any = None, long_chunk_tokens: int = 1 << 30
    ) -> None:
        import torch

        self.model = model
        self.long_chunk_tokens = long_chunk_tokens  # chunks this long or longer go to cudnn_attention
        config = model.config
        shape = (num_blocks, _BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
        for attn in model.attention_layers():
            attn.k_cache = torch.zeros(shape).to(cache_dtype or torch.float32)
            attn.v_cache = torch.zeros(shape).to(cache_dtype or torch.float32)
        self.next_block = num_blocks - 1  # hand out from the end so block ids are not positions
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> list[Any]:
        """Run one flattened batch: `{seq_id: new tokens}`; returns each sequence's logits rows."""
        import numpy as np
        import torch

        from pagoda.service.engine.runner.pipeline import attention_metadata

        input_ids, positions, slots, query_start, seq_lens = [], [], [], [0], []
        for seq_id, tokens in chunks.items():
            start = self.lens.get(seq_id, 0)
            end = start + len(tokens)
            blocks = self.blocks.setdefault(seq_id, [])
            while len(blocks) * _BLOCK_SIZE < end:
                blocks.append(self.next_block)
                self.next_block -= 1
            input_ids += tokens
            positions += range(start, end)
            slots += [blocks[p // _BLOCK_SIZE] * _BLOCK_SIZE + p % _BLOCK_SIZE for p in range(start, end)]
            query_start.append(query_start[-1] + len(tokens))
            seq_lens.append(end)
            self.lens[seq_id] = end
        width = max(len(self.blocks[s]) for s in chunks)
        tables = [self.blocks[s] + [0] * (width - len(self.blocks[s])) for s in chunks]
        batch = {
            "slot_mapping": np.asarray(slots),
            "block_tables": np.asarray(tables),
            "seq_lens": np.asarray(seq_lens),
            "query_start_loc": np.asarray(query_start),
            "max_query_len": max(len(t) for t in chunks.values()),
        }
        meta = attention_metadata(batch, torch.device("cpu"), self.long_chunk_tokens)
        self.last_meta = meta
        with torch.inference_mode():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), meta)
            logits = self.model.compute_logits(hidden)
        return list(logits.split([len(t) for t in chunks.values()]))


@pytest.fixture
def paged_runner() -> type[PagedRunner]:
    """`paged_runner(model)`: runs flattened batches of `{seq_id: new tokens}` over a fresh paged KV cache."""
    return PagedRunner


def hf_greedy_tokens(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers `generate()`, greedy, one prompt at a time (no padding), new tokens only."""
    from pagoda.bench.gpu_check import hf_generate

    return hf_generate(model, prompts, new_tokens)


@pytest.fixture
def hf_greedy() -> Any:
    """`hf_greedy(model, prompts, new_tokens)`: the reference greedy continuations."""
    return hf_greedy_tokens


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """`pagoda serve` on the embedded SmolLM2 (1024-token context, 64 MiB of KV cache, 16 sequences),
    one per xdist worker, for the API modules that only send it requests (tools, structured output,
    Responses, Messages): one start per worker instead of one per module. It must stop cleanly."""
    from pagoda.service.serve_process import ServeProcess

    args = ["--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "16"]
    with ServeProcess(args, log_path=tmp_path_factory.mktemp("serve") / "serve.log") as proc:
        yield proc
    assert proc.proc is not None and proc.proc.returncode == 0, proc.log()[-3000:]


@pytest.fixture
def cudnn_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """`[n, whole]`: how many times `cudnn_attention.chunk_attention` or `prompt_attention` ran during the
    test, and `prompt_attention` alone (both still run)."""
    from pagoda.kernels import cudnn_attention

    calls = [0, 0]

    def counting(name: str, whole: bool) -> None:
        real = getattr(cudnn_attention, name)

        def counted(*args: Any, **kwargs: Any) -> None:
            calls[0] += 1
            calls[1] += whole
            real(*args, **kwargs)

        monkeypatch.setattr(cudnn_attention, name, counted)

    counting("chunk_attention", False)
    counting("prompt_attention", True)
    return calls
