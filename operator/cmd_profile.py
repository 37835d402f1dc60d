"""`pagoda profile`: the operator's profile choice, offline, for one GPU model and count."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from pagoda.operator.catalogue import CATALOGUE, resolve
from pagoda.operator.gpus import KNOWN_GPUS, GpuGroup, known_group
from pagoda.operator.profile import (
    DEFAULT_KV_CACHE_FRACTION,
    KV_CACHE_DTYPES,
    PRECISIONS,
    TP_DEGREES,
    ProfileRequest,
    select_profile,
)

HELP = (
    "Show which precision, tensor- and pipeline-parallel degree a model gets on a GPU (offline, no cluster)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, help=f"model name; sized from the catalogue ({', '.join(CATALOGUE)})"
    )
    parser.add_argument("--parameters", help="model size for names outside the catalogue, e.g. 8B, 70B, 135M")
    parser.add_argument(
        "--gpu",
        required=True,
        help=f"nvidia.com/gpu.product value or a token of it (H100, L4); known: {', '.join(KNOWN_GPUS)}",
    )
    parser.add_argument("--count", type=int, default=1, help="GPUs per node")
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="nodes of this GPU: a model no node holds may run over several (pipeline parallelism)",
    )
    parser.add_argument("--compute-capability", help="for GPUs outside the table, e.g. 8.9")
    parser.add_argument("--memory-mib", type=int, help="per-GPU memory for GPUs outside the table")
    parser.add_argument("--precision", choices=PRECISIONS, default="auto")
    parser.add_argument(
        "--tensor-parallel-size", type=int, choices=TP_DEGREES, help="default: the smallest that fits"
    )
    parser.add_argument("--max-model-len", type=int, help="longest sequence the KV cache must hold")
    parser.add_argument(
        "--kv-cache-fraction",
        type=float,
        default=DEFAULT_KV_CACHE_FRACTION,
        help="share of GPU memory the server may use (--gpu-memory-utilization)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="fp8: an e4m3 KV cache, half the bytes per token (engine.kvCacheDtype)",
    )
    parser.add_argument("--output", choices=("text", "json"), default="text")


def _group(args: argparse.Namespace) -> GpuGroup:
    if args.count < 1:
        raise ValueError(f"--count {args.count}: must be at least 1")
    if args.nodes < 1:
        raise ValueError(f"--nodes {args.nodes}: must be at least 1")
    nodes = tuple(f"node-{i}" for i in range(args.nodes))
    if args.compute_capability or args.memory_mib:
        if not (args.compute_capability and args.memory_mib):
            raise ValueError("--compute-capability and --memory-mib go together")
        major, _, minor = args.compute_capability.partition(".")
        if not (major.isdigit() and minor.isdigit()):
            cc = args.compute_capability
            raise ValueError(f"--compute-capability {cc!r}: expected MAJOR.MINOR, e.g. 8.9")
        cc = (int(major), int(minor))
        return GpuGroup(args.gpu, cc, args.memory_mib, args.count, labels=(args.gpu,), node_names=nodes)
    return dataclasses.replace(known_group(args.gpu, args.count), node_names=nodes)


def run(args: argparse.Namespace) -> int:
    try:
        request = ProfileRequest(
            model=resolve(args.model, args.parameters),
            precision=args.precision,
            tensor_parallel_size=args.tensor_parallel_size,
            kv_cache_fraction=args.kv_cache_fraction,
            max_model_len=args.max_model_len,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        group = _group(args)
    except ValueError as err:
        print(f"pagoda profile: {err}", file=sys.stderr)
        return 2
    decision = select_profile(request, [group])
    if args.output == "json":
        out = decision.to_dict()
        out.pop("gpu", None)
        out = {"model": request.model.name, "gpu": group.product, "count": group.num_gpus} | out
        print(json.dumps(out, indent=2))
    else:
        print(f"model      {request.model.name} ({request.model.size_label} parameters)")
        print(f"gpu        {group.describe()}")
        if decision.is_selected:
            print(f"precision  {decision.precision} (KV cache {decision.kv_cache_dtype})")
            print(f"tp         {decision.tensor_parallel_size}")
            if decision.is_multi_node:
                print(f"pp         {decision.pipeline_parallel_size} (pods of one replica)")
        print(f"{'reason':<10} {decision.reason}")
        for rejection in decision.rejected:
            print(f"rejected   {rejection.candidate}: {rejection.reason}")
    return 0 if decision.is_selected else 1
