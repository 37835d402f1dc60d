"""`pagoda serve`: the OpenAI-compatible HTTP server, the gRPC server and /metrics over one engine.

Every flag also reads from an environment variable, PAGODA_ plus the flag's name in capitals with
dashes as underscores (--max-num-seqs: PAGODA_MAX_NUM_SEQS); a flag on the command line wins. The
operator configures pods this way. This module imports no torch: `pagoda serve --help` is instant.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

HELP = "Serve a model over the OpenAI-compatible HTTP API, gRPC and Prometheus /metrics."

# int8 is not offered (no kernels for it): argparse refuses it, and the operator never picks it.
PRECISIONS = ("auto", "bf16", "fp16", "fp32", "fp8")
TOOL_CALL_PARSERS = ("auto", "hermes", "mistral", "llama3_json", "none")  # = api.tool_calls.PARSERS
# --precision -> (EngineConfig.dtype, EngineConfig.quantization). fp8 keeps bf16 (auto) for everything
# but the projections.
PRECISION_DTYPES: dict[str, tuple[str, str | None]] = {
    "auto": ("auto", None),
    "bf16": ("bfloat16", None),
    "fp16": ("float16", None),
    "fp32": ("float32", None),
    "fp8": ("auto", "fp8"),
}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def env_name(flag: str) -> str:
    return "PAGODA_" + flag.lstrip("-").replace("-", "_").upper()


def _env_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE | _FALSE:
        return lowered in _TRUE
    raise ValueError(f"expected true or false, got {value!r}")


# A LeaderWorkerSet gives each pod of a group these (https://lws.sigs.k8s.io): the flags --nnodes,
# --node-rank and --master-addr default to them.
LWS_GROUP_SIZE, LWS_WORKER_INDEX, LWS_LEADER_ADDRESS = (
    "LWS_GROUP_SIZE",
    "LWS_WORKER_INDEX",
    "LWS_LEADER_ADDRESS",
)


def node_placement(
    nnodes: int | None,
    node_rank: int | None,
    master_addr: str | None,
    is_headless: bool,
    environ: Mapping[str, str],
) -> tuple[int, int, str | None, bool]:
    """(nnodes, node_rank, master_addr, is_headless): each flag as given (on the command line or as its
    PAGODA_ variable), else from a LeaderWorkerSet's variables, else one node. A worker index above 0
    from LWS_WORKER_INDEX makes the node headless, as every LWS worker pod is."""

    def lws_int(name: str) -> int | None:
        value = environ.get(name, "").strip()
        if not value:
            return None
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not a number") from None

    if nnodes is None:
        nnodes = lws_int(LWS_GROUP_SIZE) or 1
    if node_rank is None:
        node_rank = lws_int(LWS_WORKER_INDEX) or 0
        is_headless = is_headless or node_rank > 0
    if master_addr is None:
        master_addr = environ.get(LWS_LEADER_ADDRESS, "").strip() or None
    return nnodes, node_rank, master_addr, is_headless


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pagoda.service.engine.config import (
        DEFAULT_MASTER_PORT,
        DEFAULT_STALL_TIMEOUT_S,
    )  # standard library only

    def flag(
        name: str, help: str, default: Any = None, type: Callable[[str], Any] = str, **kwargs: Any
    ) -> None:
        env = env_name(name)
        if env in os.environ:
            default = os.environ[env]  # argparse applies `type` to string defaults
        parser.add_argument(name, default=default, type=type, help=f"{help} [env: {env}]", **kwargs)

    def boolean(name: str, help: str, default: bool) -> None:
        env = env_name(name)
        if env in os.environ:
            try:
                default = _env_bool(os.environ[env])
            except ValueError as exc:
                parser.error(f"{env}: {exc}")
        parser.add_argument(
            name, default=default, action=argparse.BooleanOptionalAction, help=f"{help} [env: {env}]"
        )

    def lora_module(value: str) -> Any:
        from pagoda.service.engine.config import LoRAModule  # standard library only

        try:
            return LoRAModule.parse(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    def optional_int(value: str) -> int | None:
        return None if value.strip().lower() in ("", "none", "auto") else int(value)

    flag(
        "--model", "Hugging Face checkpoint folder or .gguf file; unset: the embedded SmolLM2-135M-Instruct."
    )
    flag(
        "--served-model-name",
        "The name clients pass as `model`; unset: the checkpoint's folder or file name.",
    )
    flag("--host", "Address the HTTP and gRPC servers listen on.", "0.0.0.0")
    flag("--port", "HTTP port: the OpenAI API, /v1/health/*, /metrics (0 picks a free one).", 8000, int)
    flag(
        "--grpc-port",
        "gRPC port: pagoda.v1.Inference, grpc.health.v1, reflection (0 picks a free one).",
        8001,
        int,
    )
    flag(
        "--precision",
        "Weight and activation precision: auto (bf16 on GPUs that have it, fp32 on the CPU), bf16, fp16, "
        "fp32, or fp8 (W8A8 projections on compute capability 8.9+; emulated on the CPU). No int8: the "
        "engine has no kernels for it.",
        "auto",
        choices=PRECISIONS,
    )
    flag(
        "--tensor-parallel-size",
        "Ranks to shard the model over: that many GPUs (NCCL), or that many CPU processes (gloo) "
        "with --device cpu or no GPU.",
        1,
        int,
    )
    flag(
        "--pipeline-parallel-size",
        "Stages to split the model's layers over, each of --tensor-parallel-size ranks: P x T GPUs (or CPU "
        "processes) in all. Steps run in micro-batches that overlap across stages, eagerly (no CUDA "
        "graphs); not with a draft model or LoRA (docs/parallelism.md).",
        1,
        int,
    )
    flag(
        "--nnodes",
        "Nodes (pods) that the P x T ranks span, as many on each: node k runs ranks [k R, (k + 1) R), R = "
        "P x T / nnodes, on its GPUs 0..R-1; node 0 serves the API (docs/parallelism.md). Unset: "
        f"{LWS_GROUP_SIZE} under a LeaderWorkerSet, else 1.",
        None,
        optional_int,
    )
    flag(
        "--node-rank",
        f"This node's index, 0..nnodes-1 (nodes other than 0 need --headless). Unset: {LWS_WORKER_INDEX} "
        "under a LeaderWorkerSet (above 0 it implies --headless), else 0.",
        None,
        optional_int,
    )
    flag(
        "--master-addr",
        "Where the other nodes reach node 0 (its rendezvous store and rank 0); needed with --nnodes > 1. "
        f"Unset: {LWS_LEADER_ADDRESS} under a LeaderWorkerSet.",
        None,
    )
    flag(
        "--master-port",
        "Port of node 0's rendezvous store, the one port between nodes fixed in advance (the others are "
        "picked at start and exchanged through it).",
        DEFAULT_MASTER_PORT,
        int,
    )
    boolean(
        "--headless",
        "Serve no API (node 0's API flags are ignored): run this node's ranks of the engine that node 0 "
        "serves (--node-rank > 0), with /v1/health/live, /v1/health/ready and /health on --port for the "
        "pod's probes.",
        False,
    )
    flag(
        "--max-model-len",
        "Longest prompt + output in tokens; unset: the model's own limit.",
        None,
        optional_int,
    )
    flag("--max-num-seqs", "Most sequences in one running batch.", 256, int)
    flag(
        "--max-num-batched-tokens",
        "Token budget of one engine step (longer prefills are chunked).",
        2048,
        int,
    )
    flag(
        "--max-mixed-prefill-tokens",
        "Prefill tokens one step may add while requests decode (0: up to the step budget); lower keeps "
        "the streams' inter-token latency even when prompts arrive, at some cost in time to first token.",
        256,
        int,
    )
    flag("--block-size", "Tokens per KV cache block (a power of two).", 16, int)
    flag(
        "--kv-cache-dtype",
        "KV cache element type: auto (the model's) or fp8 (e4m3: twice the tokens, half the reads).",
        "auto",
        choices=("auto", "fp8"),
    )
    flag(
        "--cuda-graph-max-tokens",
        "Largest step mixing prefill chunks with decodes that replays a CUDA graph; 0: decode steps only.",
        2048,
        int,
    )
    flag(
        "--max-cudagraph-capture-size",
        "Largest decode batch that replays a decode CUDA graph (vLLM's compilation config field); larger "
        "ones replay a mixed graph or run eagerly. Past 256 the captured sizes step by 128.",
        1024,
        int,
    )
    flag(
        "--long-prefill-attention",
        "Attention of prompt chunks of 4096+ tokens: cudnn (cuDNN's fused attention over the gathered "
        "context: a 32k prompt's TTFT 1.27 s -> 0.98 s on an H100) or paged (the Triton kernel, as every "
        "other row). Where cuDNN lacks the shape (fp32, head_dim > 128, pre-Ampere GPUs) paged runs.",
        "cudnn",
        choices=("paged", "cudnn"),
    )
    flag(
        "--gpu-memory-utilization",
        "Fraction of the GPU memory the engine uses, weights and KV cache included (as vLLM's).",
        0.9,
        float,
    )
    flag(
        "--kv-cache-memory-bytes",
        "KV cache size in bytes; overrides --gpu-memory-utilization (the CPU default is 512 MiB).",
        None,
        optional_int,
    )
    boolean("--enable-prefix-caching", "Share the KV cache of identical prompt prefixes.", True)

    def json_config(name: str) -> Any:
        """A parser of a flag's JSON into the engine config class `name` (its `from_json`)."""

        def parse(value: str) -> Any:
            from pagoda.service.engine import config  # standard library only

            if not value:
                return None
            try:
                return getattr(config, name).from_json(value)
            except (ValueError, TypeError) as exc:  # argparse makes this a usage error naming the flag
                raise argparse.ArgumentTypeError(str(exc)) from exc

        return parse

    flag(
        "--kv-events-config",
        'vLLM\'s KV-cache events as JSON, e.g. \'{"enable_kv_cache_events": true, "endpoint": '
        '"tcp://*:5557", "topic": "kv"}\': block stored / removed / all cleared on ZMQ, msgpack.',
        None,
        json_config("KVEventsConfig"),
    )

    flag(
        "--speculative-config",
        'vLLM\'s speculative decoding as JSON: prompt lookup, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\', or a draft model, '
        '\'{"model": PATH, "num_speculative_tokens": 4}\'; Pagoda\'s "max_batch_tokens" (128) and "adaptive" '
        "(true) decide how much a step drafts (docs/speculative.md).",
        None,
        json_config("SpeculativeConfig"),
    )
    boolean(
        "--enable-lora",
        "Serve LoRA adapters (PEFT format) beside the base model: a request names one in `model` "
        "(docs/lora.md).",
        False,
    )
    lora_env = env_name("--lora-modules")
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[lora_module(m) for m in os.environ.get(lora_env, "").split()],
        type=lora_module,
        metavar="NAME=PATH",
        help='Adapters to serve from start-up, NAME=PATH or \'{"name": NAME, "path": PATH}\' '
        f"(needs --enable-lora) [env: {lora_env}, space-separated]",
    )
    flag("--max-loras", "Adapters in GPU slots at once: a step serves requests of at most this many.", 1, int)
    flag("--max-lora-rank", "The largest adapter rank (r) served; a larger one is refused.", 16, int)
    flag(
        "--max-cpu-loras",
        "Adapters kept in host memory (least recently used leave first); default: --max-loras.",
        None,
        optional_int,
    )
    boolean(
        "--async-scheduling",
        "Queue each step on the GPU before reading the last one's tokens (one GPU rank; off: in turn).",
        True,
    )
    flag(
        "--max-waiting-requests",
        "Refuse new requests with 503 + Retry-After (gRPC RESOURCE_EXHAUSTED) while this many wait; "
        "0: no limit.",
        1024,
        int,
    )
    flag(
        "--engine-stall-timeout",
        "Seconds that requests may wait with no engine step before liveness and readiness fail and the "
        "engine core's stacks are logged; 0: never.",
        DEFAULT_STALL_TIMEOUT_S,
        float,
    )
    flag(
        "--drain-timeout",
        "Seconds that in-flight requests get to finish after SIGTERM before they are aborted.",
        30.0,
        float,
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="A key clients must send as `Authorization: Bearer <key>` (gRPC: `authorization` metadata); "
        "repeat for several. Probes and /metrics stay open. Prefer the env var, which `ps` does not show "
        f"[env: {env_name('--api-key')}, comma-separated]",
    )
    flag(
        "--allowed-origins",
        "Comma-separated origins allowed by CORS (`*` for any); unset: no CORS.",
        "",
    )
    flag(
        "--max-request-bytes",
        "Largest HTTP request body; larger ones get 413 before they are read (0: no limit).",
        16 << 20,
        int,
    )
    flag(
        "--body-read-timeout",
        "Seconds a client has to send a whole request body; slower ones get 408 (0: no limit).",
        30.0,
        float,
    )
    flag(
        "--max-header-bytes",
        "Largest HTTP request head (request line and headers); larger ones get 431 (0: no limit).",
        64 << 10,
        int,
    )
    flag(
        "--tool-call-parser",
        "How `tool_choice: auto` finds calls in the model's text: hermes (<tool_call>), mistral "
        "([TOOL_CALLS]), llama3_json, none, or auto (from the chat template).",
        "auto",
        choices=TOOL_CALL_PARSERS,
    )
    flag(
        "--api-server-count",
        "Processes serving HTTP and gRPC (tokenizing, detokenizing, streaming) on the same ports in front "
        "of one engine core; more than 1 when one process cannot keep up with the engine.",
        1,
        int,
    )
    flag("--device", "auto (cuda when there is a GPU, else cpu), cuda, cuda:N or cpu.", "auto")
    flag("--seed", "Seed of the engine's random generator (requests with a `seed` have their own).", 0, int)
    # No environment variable on purpose: a stand-in for the model is only ever asked for on the command line.
    parser.add_argument(
        "--executor-class",
        default=None,
        help="Another model side as MODULE:CLASS, for benchmarks and tests "
        "(pagoda.service.engine.runner.null_executor:NullExecutor: no model). Default: the model.",
    )
    flag("--log-level", "Logging level.", "info", choices=("debug", "info", "warning", "error"))


def build_configs(args: argparse.Namespace) -> tuple[Any, Any]:
    """(ServerConfig, EngineConfig) from parsed arguments; ValueError naming the bad value."""
    from pagoda.service.engine.config import EngineConfig
    from pagoda.service.server import ServerConfig

    if args.precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {args.precision!r}")
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}")
    if args.pipeline_parallel_size < 1:
        raise ValueError(f"--pipeline-parallel-size must be at least 1, got {args.pipeline_parallel_size}")
    if args.model and not os.path.exists(args.model):
        raise ValueError(f"--model {args.model}: no such checkpoint folder or .gguf file")
    for name in ("port", "grpc_port"):
        if not 0 <= getattr(args, name) <= 65535:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 65535], got {getattr(args, name)}")
    if args.port == args.grpc_port and args.port != 0:
        raise ValueError(f"--port and --grpc-port must differ, both are {args.port}")
    if args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    if args.engine_stall_timeout < 0:
        raise ValueError(f"--engine-stall-timeout must be >= 0, got {args.engine_stall_timeout}")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if args.body_read_timeout < 0:
        raise ValueError(f"--body-read-timeout must be >= 0, got {args.body_read_timeout}")
    if args.max_header_bytes < 0:
        raise ValueError(f"--max-header-bytes must be >= 0, got {args.max_header_bytes}")
    if args.max_request_bytes < 0:
        raise ValueError(f"--max-request-bytes must be >= 0, got {args.max_request_bytes}")
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {args.api_server_count}")
    nnodes, node_rank, master_addr, is_headless = node_placement(
        args.nnodes, args.node_rank, args.master_addr, args.headless, os.environ
    )
    if is_headless and node_rank == 0:
        raise ValueError(
            "--headless is for nodes 1..N-1 of --nnodes N (--node-rank > 0): node 0 serves the API and rank 0"
        )
    if node_rank > 0 and not is_headless:
        raise ValueError(
            f"--node-rank {node_rank}: only node 0 serves the API; run the other nodes --headless"
        )
    api_keys = args.api_key or os.environ.get(env_name("--api-key"), "").split(",")
    api_keys = tuple(key.strip() for key in api_keys if key.strip())
    check_gpu(args.precision, args.device, args.kv_cache_dtype)
    server = ServerConfig(
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        max_waiting_requests=args.max_waiting_requests,
        drain_timeout_s=args.drain_timeout,
        engine_stall_timeout_s=args.engine_stall_timeout,
        log_level=args.log_level,
        api_keys=api_keys,
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
        max_request_bytes=args.max_request_bytes,
        body_read_timeout_s=args.body_read_timeout,
        max_header_bytes=args.max_header_bytes,
        tool_call_parser=args.tool_call_parser,
        api_server_count=args.api_server_count,
        headless=is_headless,
    )
    engine = EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=PRECISION_DTYPES[args.precision][0],  # type: ignore[arg-type]
        quantization=PRECISION_DTYPES[args.precision][1],  # type: ignore[arg-type]
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_mixed_prefill_tokens=args.max_mixed_prefill_tokens,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        max_cudagraph_capture_size=args.max_cudagraph_capture_size,
        long_prefill_attention=args.long_prefill_attention,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        async_scheduling=None if args.async_scheduling else False,
        executor_class=args.executor_class,
        kv_events=args.kv_events_config,
        speculative=args.speculative_config,
        lora=lora_config(args),
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=args.master_port,
    )
    return server, engine


def lora_config(args: argparse.Namespace) -> Any:
    """--enable-lora and its flags -> LoRAConfig (None without --enable-lora); adapters without it are
    refused, as vLLM does."""
    from pagoda.service.engine.config import LoRAConfig

    if not args.enable_lora:
        if args.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    return LoRAConfig(tuple(args.lora_modules), args.max_loras, args.max_lora_rank, args.max_cpu_loras)


def check_gpu(precision: str, device: str, kv_cache_dtype: str = "auto") -> None:
    """Refuse, before loading anything, what the GPU cannot run: read through NVML, no torch import."""
    needs_cc = precision in ("bf16", "fp8") or kv_cache_dtype == "fp8"
    if device == "cpu" or (not needs_cc and not device.startswith("cuda")):
        return
    try:
        import pynvml

        pynvml.nvmlInit()
        num_gpus = pynvml.nvmlDeviceGetCount()
    except Exception:
        num_gpus = 0
    if num_gpus == 0:
        if device.startswith("cuda"):
            raise ValueError(f"--device {device}: no NVIDIA GPU found (NVML)")
        return  # --precision bf16 with --device auto on a machine without GPU: the engine runs on the CPU
    index = int(device.split(":", 1)[1]) if device.startswith("cuda:") else 0
    if index >= num_gpus:
        raise ValueError(f"--device {device}: only {num_gpus} GPU(s) visible")
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    cc = tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle))
    needs = [  # (the flag, the compute capability it needs, its generation, the way out, whether asked)
        ("--precision fp8", (8, 9), "Ada, Hopper", "use --precision bf16 or fp16", precision == "fp8"),
        ("--kv-cache-dtype fp8", (8, 9), "Ada, Hopper", "use --kv-cache-dtype auto", kv_cache_dtype == "fp8"),
        ("--precision bf16", (8, 0), "Ampere", "use --precision fp16", precision == "bf16"),
    ]
    for flag, need, generation, instead, asked in needs:
        if asked and cc < need:
            name = pynvml.nvmlDeviceGetName(handle)
            raise ValueError(
                f"{flag} needs compute capability {need[0]}.{need[1]} ({generation}) or newer; GPU {index} "
                f"({name}) has {cc[0]}.{cc[1]}: {instead}"
            )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.api_server_count <= 1:
        return _serve(args, None)
    # The API processes' sockets to the core, and their request metrics: prometheus_client reads
    # PROMETHEUS_MULTIPROC_DIR when it is imported (by build_configs), and the other processes inherit it.
    run_dir = tempfile.mkdtemp(prefix="pagoda-serve-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(run_dir, "metrics")
    os.mkdir(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    try:
        return _serve(args, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _serve(args: argparse.Namespace, run_dir: str | None) -> int:
    try:
        server_config, engine_config = build_configs(args)
    except ValueError as exc:
        print(f"pagoda serve: error: {exc}", file=sys.stderr)
        return 2
    logging.getLogger(__name__).info("engine config: %s", engine_config)
    if server_config.headless:
        from pagoda.service.headless import run_headless

        return run_headless(server_config, engine_config)
    from pagoda.service.engine.client.async_engine import AsyncEngine, CoreLink
    from pagoda.service.server import serve

    if run_dir is None:
        factory = functools.partial(AsyncEngine, log_level=args.log_level)
        return asyncio.run(serve(server_config, engine_config, factory))
    from pagoda.service.api_server_process import ApiServerProcesses

    link = CoreLink(run_dir, 0, server_config.api_server_count)
    factory = functools.partial(AsyncEngine, log_level=args.log_level, link=link)
    api_servers = ApiServerProcesses(server_config, engine_config, run_dir)
    return asyncio.run(serve(server_config, engine_config, factory, api_servers=api_servers))
