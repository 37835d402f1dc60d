"""The engine's one frozen configuration, built by the CLI (or the offline `LLM`) and validated there."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from typing import Any, Literal

# The port of rank 0's rendezvous store on the leader node when ranks span nodes (torch.distributed's
# customary MASTER_PORT; vLLM's --master-port defaults to 29501).
DEFAULT_MASTER_PORT = 29500

# Longer than any legitimate step: the longest measured while serving on the H200 is 0.22 s, Triton's
# compiles and CUDA-graph capture end before the server is ready (docs/processes.md, BENCHMARKS.md); a
# compile at first use of a shape takes seconds. vLLM waits 60 s (VLLM_ENGINE_ITERATION_TIMEOUT_S).
DEFAULT_STALL_TIMEOUT_S = 120.0

Dtype = Literal["auto", "float32", "float16", "bfloat16"]


def _json_fields(cls: type, text: str, flag: str) -> dict[str, Any]:
    """A flag's JSON object of `cls`'s fields; a ValueError names the flag and any unknown field."""
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError(f"{flag} takes a JSON object")
    known = {f.name for f in fields(cls)}
    if unknown := sorted(set(raw) - known):
        raise ValueError(f"{flag}: unknown field(s) {unknown}; known: {sorted(known)}")
    return raw


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig fields (`--kv-events-config '{"enable_kv_cache_events": true, ...}'`)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" or "null"; "zmq" when enabled and not given
    endpoint: str = "tcp://*:5557"  # bound if it has a wildcard host or is ipc/inproc, else connected
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's JSON; a ValueError names an unknown field or a bad value."""
        raw = _json_fields(cls, text, "--kv-events-config")
        if raw.get("enable_kv_cache_events") and "publisher" not in raw:
            raw["publisher"] = "zmq"
        config = cls(**raw)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be zmq or null, got {config.publisher!r}")
        if config.buffer_steps < 1 or config.hwm < 0:
            raise ValueError("--kv-events-config: buffer_steps must be >= 1 and hwm >= 0")
        return config

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


# Each lookup tries every suffix length from prompt_lookup_max down, a pass over the sequence each: the
# bound keeps a lookup of a long context a few passes (vLLM's default is 5).
MAX_PROMPT_LOOKUP = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config`: prompt lookup (`{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": n, "prompt_lookup_min": m}`) or a draft model (`{"model": DRAFT,
    "num_speculative_tokens": k}`, same tokenizer), plus Pagoda's load rule: a step drafts at most
    `max_batch_tokens` rows in all, so each of B running sequences drafts `min(k, max_batch_tokens // B
    - 1)` tokens, none once B passes `max_batch_tokens // 2` (core/speculation.py says why)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    max_batch_tokens: int = 128
    # Draft at a batch size only while drafting steps emit tokens at least as fast as plain decode
    # steps there, as measured (core/speculation.py's StepRates); false: the row cap alone.
    adaptive: bool = True
    model: str | None = None  # a draft model (same tokenizer): runner/draft_model.py

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse the flag's JSON; a ValueError names an unknown field or a bad value."""
        raw = _json_fields(cls, text, "--speculative-config")
        if raw.get("model") is not None and "method" not in raw:
            raw["method"] = "draft_model"
        return cls(**raw)

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(
                f"--speculative-config: method must be ngram or draft_model, got {self.method!r}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                '--speculative-config: a draft model is {"model": PATH, "num_speculative_tokens": k}'
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "max_batch_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"--speculative-config: {name} must be a positive integer, got {value!r}")
        if self.num_speculative_tokens > 16:
            raise ValueError(f"--speculative-config: num_speculative_tokens is at most 16, got "
                             f"{self.num_speculative_tokens}")  # fmt: skip
        lookup_max = self.prompt_lookup_max
        if type(lookup_max) is not int or not self.prompt_lookup_min <= lookup_max <= MAX_PROMPT_LOOKUP:
            raise ValueError(
                f"--speculative-config: prompt_lookup_max must be an integer from prompt_lookup_min "
                f"({self.prompt_lookup_min}) to {MAX_PROMPT_LOOKUP}, got {lookup_max!r}"
            )


@dataclass(frozen=True)
class LoRAModule:
    """An adapter served from start-up: vLLM's `--lora-modules NAME=PATH` (or its JSON form)."""

    name: str
    path: str

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        """`NAME=PATH` or `{"name": NAME, "path": PATH}`; a ValueError says which form it wants."""
        if text.lstrip().startswith("{"):
            raw = json.loads(text)
            if not isinstance(raw, dict) or not {"name", "path"} <= raw.keys():
                raise ValueError(f'--lora-modules {text!r}: the JSON form is {{"name": NAME, "path": PATH}}')
            name, path = str(raw["name"]), str(raw["path"])
        else:
            name, sep, path = text.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules {text!r}: give NAME=PATH")
        if not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules {text!r}: the name and the path may not be empty")
        return cls(name.strip(), path.strip())


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's `--enable-lora` and its limits: `max_loras` adapters in GPU slots at once (a step serves
    requests of at most that many), rank at most `max_lora_rank`, `max_cpu_loras` kept in host memory
    (least recently used leave first); `modules` load at start (runner/lora.py, docs/lora.md)."""

    modules: tuple[LoRAModule, ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_lora_rank > 512:
            raise ValueError(f"--max-lora-rank is at most 512, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras ({self.max_loras})"
            )
        names = [m.name for m in self.modules]
        if len(set(names)) < len(names):
            raise ValueError(f"--lora-modules: a name given twice ({', '.join(names)})")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # checkpoint folder or .gguf file; None: the embedded SmolLM2-135M-Instruct
    served_model_name: str | None = None
    dtype: Dtype = "auto"  # auto: bf16 on GPUs that have it, else the checkpoint's; float32 on the CPU
    quantization: Literal["fp8"] | None = None  # fp8: W8A8 decoder projections (dtype stays for the rest)
    # fp8: the KV cache holds e4m3 (half of bf16's bytes: twice the tokens, half the attention reads),
    # with per-tensor scales of 1.0 as vLLM's default; auto: the model dtype.
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    device: str = "auto"  # auto: cuda if available, else cpu
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # the per-step token budget (chunked prefill beyond it)
    # Prefill tokens a step may add while requests decode (0: up to the step budget): bounds the gap that
    # arriving prompts open in every running stream (inter-token latency), at some cost in TTFT.
    max_mixed_prefill_tokens: int = 0
    block_size: int = 16
    gpu_memory_utilization: float = 0.9  # of the whole GPU memory: weights, KV cache, activations
    kv_cache_memory_bytes: int | None = None  # overrides the fraction; the CPU default is 512 MiB
    enable_prefix_caching: bool = True
    seed: int = 0
    enforce_eager: bool = False  # on a GPU, never replay steps from CUDA graphs
    # The largest step (in tokens) that mixes prefill chunks with decodes and still replays a CUDA graph;
    # 0: decode-only steps alone (cuda_graphs.py).
    cuda_graph_max_tokens: int = 2048
    # The largest decode batch that replays a decode CUDA graph (vLLM's `max_cudagraph_capture_size`;
    # its default is 512); a larger one replays a mixed graph (cuda_graphs.py) or runs eagerly. Past
    # 256 the ladder steps by 128, and stops at the first size that holds max_num_seqs. A decode step
    # of 640 rows was 8% faster in a decode graph than in the mixed graph it took at 512 (one H100,
    # BENCHMARKS.md); the graphs share one logits buffer, so a larger ladder costs little memory.
    max_cudagraph_capture_size: int = 1024
    # "cudnn": prompt chunks of LONG_CHUNK_TOKENS (4096) or more attend through cuDNN's fused attention
    # (kernels/cudnn_attention.py), faster at long contexts; "paged": the Triton kernel for every row.
    # Checked on an H100 (tests/kernels/check_cudnn_attention.py, tests/gpu/check_engine.py).
    long_prefill_attention: Literal["paged", "cudnn"] = "cudnn"
    tensor_parallel_size: int = 1  # ranks the model is sharded over: GPUs (NCCL), or CPU processes (gloo)
    # Stages the layers are split over, each of tensor_parallel_size ranks: P x T ranks in all
    # (docs/parallelism.md).
    pipeline_parallel_size: int = 1
    # Queue step N+1 on the device before reading step N's tokens, so the host's work of a step (outputs,
    # scheduling, inputs) runs while the GPUs compute. None: on with GPUs, off on the CPU (nothing to
    # overlap there; True runs the same code, for tests).
    async_scheduling: bool | None = None
    # Another model side as `module:Class` (the executor protocol; constructed with this config, the
    # end-of-sequence ids and `relay_stop_signals`), for benchmarks and tests; None: the model.
    # `pagoda.service.engine.runner.null_executor:NullExecutor`: no model (`pagoda bench serve`'s ceiling).
    executor_class: str | None = None
    kv_events: KVEventsConfig | None = None  # vLLM's --kv-events-config (core/kv_events.py)
    speculative: SpeculativeConfig | None = None  # vLLM's --speculative-config (core/speculation.py)
    lora: LoRAConfig | None = None  # vLLM's --enable-lora and its flags; None: no adapters
    # Ranks over several nodes (vLLM's --nnodes, --node-rank, --master-addr, --master-port): node k runs
    # global ranks [k * R, (k + 1) * R), R = P x T / nnodes; node 0, the leader, serves the API and holds
    # rank 0, whose store listens on master_port; the others are `pagoda serve --headless`
    # (docs/parallelism.md, "Across nodes").
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # where the other nodes reach the leader; needed with nnodes > 1
    master_port: int = DEFAULT_MASTER_PORT

    @property
    def world_size(self) -> int:
        """Ranks of the model over all nodes: pipeline stages x tensor-parallel ranks."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    @property
    def ranks_per_node(self) -> int:
        """R: node k runs global ranks [k * R, (k + 1) * R), rank r on its cuda:(r - k * R)."""
        return self.world_size // self.nnodes

    def rank_settings(self) -> dict[str, Any]:
        """The settings every node's ranks must share (a headless node's hello carries them and the
        leader compares them with its own), as JSON values."""
        shared = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in NODE_LOCAL_FIELDS}
        return json.loads(json.dumps(shared, default=lambda value: value.__dict__))

    @property
    def model_path(self) -> str:
        """The checkpoint folder or .gguf file to load: `model`, or the embedded default."""
        from pagoda.service.model import default_model_path

        return str(self.model) if self.model else str(default_model_path())

    @property
    def model_name(self) -> str:
        """The name clients pass as `model`: the served name, else the checkpoint's folder or file name."""
        return self.served_model_name or self.model_path.rstrip("/").split("/")[-1]

    def __post_init__(self) -> None:
        positive = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.max_cudagraph_capture_size < 1:
            raise ValueError(
                f"max_cudagraph_capture_size must be at least 1, got {self.max_cudagraph_capture_size}"
            )
        for name in ("cuda_graph_max_tokens", "max_mixed_prefill_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")
        if self.long_prefill_attention not in ("paged", "cudnn"):
            raise ValueError(
                f"long_prefill_attention must be paged or cudnn, got {self.long_prefill_attention!r}"
            )
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.pipeline_parallel_size > 1:
            self._check_pipeline()
        if self.nnodes != 1 or self.node_rank != 0:
            self._check_nodes()
        if self.executor_class is not None and not re.fullmatch(r"[\w.]+:\w+", self.executor_class):
            raise ValueError(f"executor_class must be module:Class, got {self.executor_class!r}")

    def _check_pipeline(self) -> None:
        """What pipeline parallelism does not run yet is refused here, before any process starts."""
        size = self.pipeline_parallel_size
        if self.speculative is not None and self.speculative.model is not None:
            raise ValueError(
                f"pipeline_parallel_size {size}: speculative decoding with a draft model is not supported "
                "under pipeline parallelism (the draft runs whole on rank 0 beside the target's first "
                'stage); use {"method": "ngram"} or pipeline_parallel_size 1'
            )
        if self.lora is not None:
            raise ValueError(
                f"pipeline_parallel_size {size}: LoRA adapters (--enable-lora) are not supported under "
                "pipeline parallelism yet; use pipeline_parallel_size 1"
            )

    def _check_nodes(self) -> None:
        """What cannot run across nodes is refused here, before any process starts."""
        nnodes, node_rank, size = self.nnodes, self.node_rank, self.world_size
        ranks = f"the {size} ranks of --pipeline-parallel-size {self.pipeline_parallel_size} x " \
                f"--tensor-parallel-size {self.tensor_parallel_size}"  # fmt: skip
        if nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1, got {nnodes}")
        if not 0 <= node_rank < nnodes:
            raise ValueError(
                f"--node-rank must be in [0, {nnodes - 1}] with --nnodes {nnodes}, got {node_rank}"
            )
        if size % nnodes:
            raise ValueError(
                f"--nnodes {nnodes} does not divide {ranks}: every node runs as many ranks (one per GPU)"
            )
        per_node, tp = size // nnodes, self.tensor_parallel_size
        if self.pipeline_parallel_size > 1 and per_node % tp:
            raise ValueError(
                f"--nnodes {nnodes} would put {per_node} of {ranks} on each node, which splits a pipeline "
                f"stage's {tp} tensor-parallel ranks over nodes: a stage all-reduces twice a layer, so it "
                f"stays on one node and only the stage-to-stage hops cross; use an --nnodes that leaves a "
                f"multiple of {tp} ranks per node"
            )
        if not self.master_addr:
            raise ValueError(f"--nnodes {nnodes} needs --master-addr: where the other nodes reach node 0")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"--master-port must be in [1, 65535], got {self.master_port}")
        if self.executor_class is not None:
            raise ValueError(f"--executor-class {self.executor_class} runs on one node; not with --nnodes")
        if self.lora is not None:
            raise ValueError(
                f"--nnodes {nnodes}: LoRA adapters (--enable-lora) are not supported across nodes yet (each "
                "node's ranks would read the adapter files from their own file system); use one node"
            )


# What may differ between the nodes of one engine: where each reaches the leader, which node it is, the
# memory it offers the KV cache (all ranks use the smallest block count), and what only the leader's
# engine core and API read.
NODE_LOCAL_FIELDS = frozenset(
    {
        "node_rank",
        "master_addr",
        "device",
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "served_model_name",
        "max_mixed_prefill_tokens",
        "enable_prefix_caching",
        "async_scheduling",
        "executor_class",
        "kv_events",
    }
)
