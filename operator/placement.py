"""Where a workload may go now: GPU groups with free capacity, and the profile to run, stable over time.

Capacity is allocatable `nvidia.com/gpu` minus what bound, unfinished pods request; the service's own
pods are not counted against it (their GPUs are its to reuse). The current profile is read from the
Deployment or LeaderWorkerSet the operator rendered (its profile annotation), so it survives operator
restarts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagoda.operator import manifests
from pagoda.operator.gpus import gpu_groups, requested_gpus, why_no_gpu_nodes
from pagoda.operator.profile import CurrentProfile, Decision, select_profile
from pagoda.operator.spec import ServiceSpec


def current_profile(workload: Mapping[str, Any] | None) -> CurrentProfile | None:
    """`NVIDIA-H200/fp8/tp1` from the Deployment's annotation (`.../tp8/pp2` from a LeaderWorkerSet's), or
    None."""
    annotations = ((workload or {}).get("metadata") or {}).get("annotations") or {}
    value = annotations.get(manifests.ANNOTATION_PROFILE, "")
    product, _, rest = value.partition("/")
    precision, _, rest = rest.partition("/")
    tp, _, pp = rest.partition("/")
    if not (product and precision and tp.startswith("tp") and tp[2:].isdigit()):
        return None
    if pp and not (pp.startswith("pp") and pp[2:].isdigit()):
        return None
    return CurrentProfile(product, precision, int(tp[2:]), int(pp[2:]) if pp else 1)


def is_own_pod(pod: Mapping[str, Any], spec: ServiceSpec) -> bool:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    selector = manifests.selector_labels(spec)
    return meta.get("namespace") == spec.namespace and all(labels.get(k) == v for k, v in selector.items())


def decide(
    spec: ServiceSpec,
    nodes: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    current: CurrentProfile | None,
) -> Decision:
    """The profile for this spec on these nodes, given every pod in the cluster (capacity)."""
    used = requested_gpus(p for p in pods if not is_own_pod(p, spec))
    groups = gpu_groups(nodes, spec.node_selector, spec.tolerations, used)
    if not groups:
        return Decision(
            False, why_no_gpu_nodes(nodes, spec.node_selector, spec.tolerations), cause="NoGpuNodes"
        )
    return select_profile(spec.profile_request(), groups, current)


def is_same(decision: Decision, current: CurrentProfile | None) -> bool:
    gpu = decision.gpu
    return (
        current is not None
        and gpu is not None
        and (gpu.product, decision.precision, decision.tensor_parallel_size, decision.pipeline_parallel_size)
        == (current.product, current.precision, current.tensor_parallel_size, current.pipeline_parallel_size)
    )
