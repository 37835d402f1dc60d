"""What the operator keeps for itself in the pods it renders, and the checks that refuse a spec that would
take it: the `pagoda serve` flags it sets (engine.extraArgs and PAGODA_* variables may not set them), the
pod labels and annotations its selectors and metrics read, its volumes and mount paths. The CRD's CEL
rules repeat these checks at admission; tests/test_operator_contract.py holds the two together.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# What a group over several pods runs with (manifests.py, the LeaderWorkerSet's leader and workers; vLLM's
# names): the pipeline's depth, the pods of the group, each pod's rank, rank 0's address and port, and a
# worker's lack of an API.
MULTI_NODE_FLAGS: tuple[str, ...] = (
    "--pipeline-parallel-size",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--headless",
)

# The `pagoda serve` flags the operator renders from the spec and the profile (manifests.server_args).
# engine.extraArgs may not set them: not exactly, not as `--flag=value`, and not abbreviated (argparse
# takes any unique prefix, and the last occurrence wins). The CRD's CEL rule on extraArgs spells the
# same list; tests/test_operator_contract.py holds the three together.
OPERATOR_FLAGS: tuple[str, ...] = (
    "--model",
    "--served-model-name",
    "--precision",
    "--tensor-parallel-size",
    "--gpu-memory-utilization",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--max-model-len",
    "--max-num-seqs",
    "--kv-cache-dtype",
    "--api-server-count",
    "--host",
    "--port",
    "--grpc-port",
    "--drain-timeout",
    "--speculative-config",
    "--enable-lora",
    "--no-enable-lora",  # never rendered; it would switch off what spec.adapters turns on
    "--lora-modules",
    "--max-loras",
    "--max-lora-rank",
    "--max-cpu-loras",
    *MULTI_NODE_FLAGS,
)


def operator_flag(arg: str) -> str | None:
    """The operator's flag that a `pagoda serve` argument would set, if any."""
    name = arg.split("=", 1)[0]
    if not name.startswith("--") or name == "--":
        return None
    return next((flag for flag in OPERATOR_FLAGS if flag.startswith(name)), None)


def extra_args(raw: list[str] | None) -> tuple[str, ...]:
    for arg in raw or ():
        name = arg.split("=", 1)[0]
        if arg.startswith("-") and any(c.isspace() for c in name):
            # `pagoda serve` would take the whole item for one unknown flag and exit at every start.
            raise ValueError(
                f"engine.extraArgs: {arg!r} holds a flag and its value in one item: give them as "
                "two items, or as --flag=value"
            )
        if len(name) >= 5 and "--api-key".startswith(name):
            raise ValueError(
                "engine.extraArgs cannot carry --api-key (visible in the pod spec): use apiKeySecret"
            )
        if (flag := operator_flag(arg)) is not None:
            raise ValueError(
                f"engine.extraArgs: {arg!r} would override {flag}, which the operator sets "
                "from the spec and the chosen profile"
            )
    return tuple(raw or ())


def serve_env_name(flag: str) -> str:
    """The variable `pagoda serve` reads a flag from (service/cli.py env_name; the operator imports no
    service code, tests/test_operator_contract.py holds the two equal)."""
    return "PAGODA_" + flag.lstrip("-").replace("-", "_").upper()


def operator_env(name: str) -> str | None:
    """The operator's flag that a `PAGODA_*` environment variable would set, if any (`pagoda serve`
    reads every flag from PAGODA_ plus its name: a variable the command line does not override wins)."""
    return next((flag for flag in OPERATOR_FLAGS if name == serve_env_name(flag)), None)


def env(raw: list[Mapping[str, Any]] | None) -> tuple[Mapping[str, Any], ...]:
    for var in raw or ():
        name = str(var.get("name", ""))
        if name == serve_env_name("--api-key"):
            raise ValueError(f"spec.env cannot set {name}: use apiKeySecret")
        if (flag := operator_env(name)) is not None:
            raise ValueError(
                f"spec.env: {name} would set {flag}, which the operator sets from the spec and the chosen "
                "profile"
            )
    return tuple(raw or ())


# Labels and annotations the operator sets on the pods: a spec may add others, never replace these (the
# selector, status and metrics read them).
OPERATOR_POD_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
)
OPERATOR_POD_ANNOTATIONS = (
    "serving.pagoda.dev/profile",
    "prometheus.io/scrape",
    "prometheus.io/port",
    "prometheus.io/path",
)


def string_map(raw: Mapping[str, Any] | None, where: str, reserved: tuple[str, ...]) -> dict[str, str]:
    """A map of strings a spec adds to what the operator renders; the operator's own keys are refused."""
    out = {str(k): str(v) for k, v in (raw or {}).items()}
    if taken := sorted(k for k in out if k in reserved):
        raise ValueError(f"{where}: {', '.join(taken)} is set by the operator (not settable)")
    return out


# The pod's own volumes and mount paths (manifests.py): a spec's may not take their names or paths. The
# adapters' volumes are `adapters` and `adapter-<index>`.
OPERATOR_VOLUMES = ("model", "kernel-cache", "tmp", "cache", "dshm", "adapters")
OPERATOR_VOLUME_NAME = re.compile(r"^adapter-[0-9]+$")
OPERATOR_MOUNT_PATHS = (
    "/models",
    "/adapters",
    "/tmp",
    "/dev/shm",
    "/var/cache/pagoda",
    "/home/pagoda/.cache",
)


def volumes(raw: Mapping[str, Any]) -> tuple[tuple[Mapping[str, Any], ...], tuple[Mapping[str, Any], ...]]:
    volumes, mounts = tuple(raw.get("volumes") or ()), tuple(raw.get("volumeMounts") or ())
    names = [str(v.get("name")) for v in volumes]
    if taken := sorted({n for n in names if n in OPERATOR_VOLUMES or OPERATOR_VOLUME_NAME.match(n)}):
        raise ValueError(f"volumes: {', '.join(taken)} is a volume of the operator's (choose another name)")
    for mount in mounts:
        path = str(mount.get("mountPath", "")).rstrip("/")
        if any(
            path == p or path.startswith(p + "/") or p.startswith(path + "/") for p in OPERATOR_MOUNT_PATHS
        ):
            raise ValueError(f"volumeMounts: {path or '/'} overlaps a path the operator mounts")
        if mount.get("name") not in names:
            raise ValueError(f"volumeMounts: {mount.get('name')!r} names no volume in spec.volumes")
    return volumes, mounts
