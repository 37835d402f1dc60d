"""GPU discovery from node labels (NVIDIA GPU Feature Discovery), pure functions over node dicts.

Selection keys on compute capability, never on `nvidia.com/gpu.family`: `blackwell` spans 10.x
(B200) and 12.x (RTX 50xx), which differ in what they run. Time-slicing and MPS append `-SHARED`
to `nvidia.com/gpu.product` and MIG (single strategy) appends `-MIG-<profile>`: the base product
is what a user's preference names, the raw label is what node affinity must match.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

PRODUCT = "nvidia.com/gpu.product"
CC_MAJOR = "nvidia.com/gpu.compute.major"
CC_MINOR = "nvidia.com/gpu.compute.minor"
MEMORY_MIB = "nvidia.com/gpu.memory"
COUNT = "nvidia.com/gpu.count"
RESOURCE = "nvidia.com/gpu"

# The GPU Operator taints GPU nodes with this key on many clusters; every inference pod tolerates it.
GPU_TOLERATION = {"key": RESOURCE, "operator": "Exists", "effect": "NoSchedule"}

_SUFFIX = re.compile(r"-(SHARED|MIG-.*)$", re.IGNORECASE)

# Offline lookups for `pagoda profile --gpu`: product -> (compute capability, memory MiB), as GFD reports.
KNOWN_GPUS: dict[str, tuple[tuple[int, int], int]] = {
    "NVIDIA-B200": ((10, 0), 183359),
    "NVIDIA-H200": ((9, 0), 143771),
    "NVIDIA-H100-80GB-HBM3": ((9, 0), 81559),
    "NVIDIA-H100-PCIe": ((9, 0), 81559),
    "NVIDIA-A100-SXM4-80GB": ((8, 0), 81920),
    "NVIDIA-A100-SXM4-40GB": ((8, 0), 40960),
    "NVIDIA-L40S": ((8, 9), 46068),
    "NVIDIA-L4": ((8, 9), 23034),
    "NVIDIA-A10G": ((8, 6), 23028),
    "Tesla-T4": ((7, 5), 15360),
    "Tesla-V100-SXM2-16GB": ((7, 0), 16384),
}


@dataclasses.dataclass(frozen=True)
class GpuGroup:
    """Nodes with the same GPU model and count: one candidate for selection."""

    product: str  # base product, suffix removed: NVIDIA-H100-80GB-HBM3
    compute_capability: tuple[int, int]
    memory_mib: int  # per GPU (per MIG slice under MIG)
    num_gpus: int  # per node
    labels: tuple[str, ...] = ()  # raw nvidia.com/gpu.product values, for node affinity
    node_names: tuple[str, ...] = ()
    is_shared: bool = False
    free_gpus: tuple[int, ...] | None = (
        None  # per node (as node_names): allocatable - requested; None: unknown
    )

    @property
    def max_free(self) -> int:
        """The most GPUs one replica can get on one node of the group (all of them when unknown)."""
        return max(self.free_gpus) if self.free_gpus else self.num_gpus

    def room_for(self, gpus_per_pod: int, is_free: bool = False) -> int | None:
        """How many pods of `gpus_per_pod` GPUs the group's nodes hold (is_free: in the GPUs no other pod
        holds); None where unknown (no free counts, or a group named offline, without nodes)."""
        if is_free:
            return None if self.free_gpus is None else sum(f // gpus_per_pod for f in self.free_gpus)
        return len(self.node_names) * (self.num_gpus // gpus_per_pod) if self.node_names else None

    @property
    def cc(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024

    def describe(self) -> str:
        return f"{self.num_gpus} x {self.product} ({self.memory_gib:.0f} GiB, cc {self.cc})"


def base_product(product: str) -> str:
    return _SUFFIX.sub("", product)


def known_group(product: str, num_gpus: int) -> GpuGroup:
    """A group for a product given by name (offline use); unknown names raise ValueError."""
    base = base_product(product)
    matches = [name for name in KNOWN_GPUS if matches_product(name, base)]
    if len(matches) != 1:
        known = ", ".join(KNOWN_GPUS)
        raise ValueError(f"GPU {product!r}: expected one of {known} (or give --compute-capability/--memory)")
    cc, memory = KNOWN_GPUS[matches[0]]
    return GpuGroup(matches[0], cc, memory, num_gpus, labels=(product,))


def matches_product(product: str, wanted: str) -> bool:
    """`H100` and `NVIDIA-H100` match `NVIDIA-H100-80GB-HBM3`; `A10` does not match `NVIDIA-A100-...`.

    Every dash-separated token of the wanted name must be a token of the product (case-insensitive).
    """
    have = set(base_product(product).upper().split("-"))
    return all(token in have for token in wanted.upper().split("-") if token)


def _int_label(labels: Mapping[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


def _num_gpus(node: Mapping[str, Any], labels: Mapping[str, str], is_shared: bool) -> int:
    # Allocatable is what the scheduler hands out; under time-slicing it counts replicas, not GPUs,
    # and tensor parallelism across replicas of one GPU gains nothing: use the physical count there.
    allocatable = _int_label(node.get("status", {}).get("allocatable", {}) or {}, RESOURCE)
    count = _int_label(labels, COUNT)
    if is_shared or allocatable is None:
        return count or 0
    return allocatable


def is_schedulable(node: Mapping[str, Any], tolerations: Iterable[Mapping[str, Any]] = ()) -> bool:
    """Ready, not cordoned, and every NoSchedule/NoExecute taint tolerated."""
    spec = node.get("spec", {}) or {}
    if spec.get("unschedulable"):
        return False
    conditions = (node.get("status", {}) or {}).get("conditions") or []
    ready = [c for c in conditions if c.get("type") == "Ready"]
    if ready and ready[0].get("status") != "True":
        return False
    tolerations = [*tolerations, GPU_TOLERATION]
    return all(
        taint.get("effect") == "PreferNoSchedule" or any(_tolerates(t, taint) for t in tolerations)
        for taint in spec.get("taints") or []
    )


def _tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return not toleration.get("key") or toleration["key"] == taint.get("key")
    return toleration.get("key") == taint.get("key") and toleration.get("value", "") == taint.get("value", "")


def matches_selector(node: Mapping[str, Any], node_selector: Mapping[str, str]) -> bool:
    labels = node.get("metadata", {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in node_selector.items())


def _pod_gpus(pod: Mapping[str, Any]) -> int:
    """GPUs a pod holds: the sum over its containers, or its largest init container if that is more."""
    spec = pod.get("spec") or {}

    def gpus(container: Mapping[str, Any]) -> int:
        resources = container.get("resources") or {}
        wanted = (resources.get("requests") or {}).get(RESOURCE) or (resources.get("limits") or {}).get(
            RESOURCE
        )
        return int(wanted or 0)

    main = sum(gpus(c) for c in spec.get("containers") or ())
    return max([main, *(gpus(c) for c in spec.get("initContainers") or ())])


def requested_gpus(pods: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """node name -> GPUs requested by the pods bound to it that have not finished."""
    used: dict[str, int] = {}
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if node and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            used[node] = used.get(node, 0) + _pod_gpus(pod)
    return used


def why_no_gpu_nodes(
    nodes: Iterable[Mapping[str, Any]],
    node_selector: Mapping[str, str] | None = None,
    tolerations: Iterable[Mapping[str, Any]] = (),
) -> str:
    """Why gpu_groups() found nothing: no labelled nodes, or labelled ones that the spec or state excludes."""
    tolerations = list(tolerations)
    labelled = [n for n in nodes if (n.get("metadata", {}).get("labels") or {}).get(PRODUCT)]
    if not labelled:
        return "no schedulable GPU nodes (none has the nvidia.com/gpu.product label)"
    unselected = [n for n in labelled if not matches_selector(n, node_selector or {})]
    blocked = [n for n in labelled if n not in unselected and not is_schedulable(n, tolerations)]
    parts = [f"{len(labelled)} GPU nodes"]
    if unselected:
        parts.append(f"{len(unselected)} excluded by the nodeSelector")
    if blocked:
        parts.append(f"{len(blocked)} cordoned, not ready or tainted without a toleration")
    return "no schedulable GPU nodes: " + ", ".join(parts)


def gpu_groups(
    nodes: Iterable[Mapping[str, Any]],
    node_selector: Mapping[str, str] | None = None,
    tolerations: Iterable[Mapping[str, Any]] = (),
    used: Mapping[str, int] | None = None,
) -> list[GpuGroup]:
    """Group the schedulable GPU nodes by (product, compute capability, memory, GPUs per node).

    used: GPUs already requested per node (requested_gpus); the groups then carry each node's free count.
    """
    tolerations = list(tolerations)
    grouped: dict[tuple[str, tuple[int, int], int, int], list[tuple[str, str, bool]]] = {}
    for node in nodes:
        labels = node.get("metadata", {}).get("labels") or {}
        product = labels.get(PRODUCT)
        major, minor = _int_label(labels, CC_MAJOR), _int_label(labels, CC_MINOR)
        memory = _int_label(labels, MEMORY_MIB)
        if not product or major is None or minor is None or not memory:
            continue
        if not matches_selector(node, node_selector or {}) or not is_schedulable(node, tolerations):
            continue
        is_shared = product.upper().endswith("-SHARED")
        num_gpus = _num_gpus(node, labels, is_shared)
        if num_gpus < 1:
            continue
        key = (base_product(product), (major, minor), memory, num_gpus)
        grouped.setdefault(key, []).append((product, node["metadata"]["name"], is_shared))
    groups = []
    for (base, cc, memory, num_gpus), members in sorted(grouped.items()):
        names = tuple(sorted(name for _, name, _ in members))
        is_shared = any(shared for _, _, shared in members)
        # Time-sliced GPUs count replicas in allocatable, not GPUs: their capacity is not counted here.
        is_counted = used is not None and not is_shared
        free = tuple(max(0, num_gpus - used.get(n, 0)) for n in names) if is_counted and used else None
        groups.append(
            GpuGroup(
                product=base,
                compute_capability=cc,
                memory_mib=memory,
                num_gpus=num_gpus,
                labels=tuple(sorted({raw for raw, _, _ in members})),
                node_names=names,
                is_shared=is_shared,
                free_gpus=free,
            )
        )
    return groups
