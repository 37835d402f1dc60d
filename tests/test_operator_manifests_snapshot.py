"""Every object the operator renders, for a few specs that reach every branch of `operator/manifests.py`,
against a reviewed copy in `tests/snapshots/manifests.json`. A change to what reaches the cluster (a
probe timing, a security setting, a resource size) shows up here as a diff to review, not silently.
After an intended change: `PAGODA_UPDATE_SNAPSHOTS=1 pytest tests/test_operator_manifests_snapshot.py`,
then read the diff of the JSON file before committing it.

Beside it, the settings whose reason lives elsewhere are checked against that reason: the pods' user
is the image's, the model is mounted read-only, a partial node rolls with a surge and no loss."""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from pagoda.operator import manifests
from pagoda.operator.gpus import GpuGroup
from pagoda.operator.profile import Decision
from pagoda.operator.spec import OperatorConfig, parse_spec

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "tests" / "snapshots" / "manifests.json"
H100 = GpuGroup("NVIDIA-H100-80GB-HBM3", (9, 0), 81559, 8, labels=("NVIDIA-H100-80GB-HBM3",))
L4 = GpuGroup("NVIDIA-L4", (8, 9), 23034, 1, labels=("NVIDIA-L4",))


def _body(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "serving.pagoda.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "llm", "namespace": "ns", "uid": "u-1", "generation": 1},
        "spec": spec,
    }


def _decision(tp: int, precision: str, gpu: GpuGroup, pp: int = 1) -> Decision:
    return Decision(
        True,
        "fits",
        gpu=gpu,
        precision=precision,
        tensor_parallel_size=tp,
        kv_cache_dtype=precision,
        pipeline_parallel_size=pp,
    )


# name -> (spec, tp, precision, GPU group, operator config[, pp: pods of a LeaderWorkerSet group])
CASES: dict[str, tuple[Any, ...]] = {
    "one GPU of eight, fp8, an image path, two API servers": (
        {"model": {"name": "llama-3.1-8b", "source": {"imagePath": "/models/llama"}},
         "engine": {"apiServerCount": 2}},
        1, "fp8", H100, OperatorConfig(),
    ),
    "a whole node, bf16, a PVC, autoscaled, three API servers": (
        {
            "model": {"name": "llama-3.1-70b", "source": {"pvc": {"claimName": "weights"}}},
            "precision": "bf16",
            "engine": {"apiServerCount": 3, "maxModelLen": 8192},
            "autoscaling": {"minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 8},
            "imagePullPolicy": "Always",
        },
        8, "bf16", H100, OperatorConfig(kernel_cache_pvc="kernels"),
    ),
    "a host path on a one-GPU node, fp16, three API servers": (
        {
            "model": {"name": "qwen2.5-7b", "source": {"hostPath": "/mnt/models/qwen"}},
            "precision": "fp16",
            "engine": {"apiServerCount": 3},
            "httpRoute": {"parentRefs": [{"name": "public", "namespace": "gateways"}]},
        },
        1, "fp16", L4, OperatorConfig(),
    ),
    "an hf:// model fetched at every start, a custom image and downloader": (
        {
            "model": {"name": "my-model", "parameters": "1.5B", "source": {"uri": "hf://org/model@v2"}},
            "image": "registry.local/pagoda-custom:1",
        },
        1, "bf16", L4, OperatorConfig(downloader_image="registry.local/downloader:1"),
    ),
    "an hf:// model in a cache volume": (
        {"model": {"name": "my-model", "parameters": "1.5B", "source": {"uri": "hf://org/model"},
                   "cache": {"size": "20Gi"}}},
        1, "bf16", L4, OperatorConfig(),
    ),
    "LoRA adapters from the model's claim, another claim, a node path and the Hub; prompt lookup": (
        {
            "model": {"name": "llama-3.1-8b", "source": {"pvc": {"claimName": "weights", "path": "llama"}}},
            "adapters": [
                {"name": "sql", "source": {"pvc": {"claimName": "weights", "path": "loras/sql"}}},
                {"name": "chat", "source": {"pvc": {"claimName": "loras", "path": "chat"}}},
                {"name": "tarot", "source": {"hostPath": "/mnt/loras/tarot"}},
                {"name": "ft:support:acme::2", "source": {"uri": "hf://acme/support-lora",
                                                          "tokenSecret": {"name": "hf"}}},
            ],
            "engine": {"maxLoraRank": 32, "maxCpuLoras": 8},
            "speculative": {"method": "ngram", "numSpeculativeTokens": 4},
        },
        1, "fp8", H100, OperatorConfig(),
    ),
    "405B bf16 over two whole nodes (a LeaderWorkerSet), an hf:// model in a cache volume, autoscaled": (
        {
            "model": {"name": "meta-llama/Llama-3.1-405B-Instruct", "source": {"uri": "hf://meta-llama/Llama-3.1-405B-Instruct"},
                      "cache": {"size": "900Gi"}},
            "precision": "bf16",
            "autoscaling": {"minReplicas": 1, "maxReplicas": 2},
            "router": {"enabled": False},
        },
        8, "bf16", H100, OperatorConfig(), 2,
    ),
}  # fmt: skip


def _render(
    spec: dict[str, Any], tp: int, precision: str, gpu: GpuGroup, config: OperatorConfig, pp: int = 1
) -> Any:
    parsed = parse_spec(_body(spec))
    return manifests.children(parsed, _decision(tp, precision, gpu, pp), config)


def _server_pods(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The server pod specs: the Deployment's template, or a LeaderWorkerSet's leader's and workers'."""
    workload = next(o for o in objects if o["kind"] in ("Deployment", "LeaderWorkerSet"))
    if workload["kind"] == "Deployment":
        return [workload["spec"]["template"]["spec"]]
    template = workload["spec"]["leaderWorkerTemplate"]
    return [template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]]


def test_the_rendered_objects_are_the_reviewed_ones() -> None:
    rendered = json.dumps({name: _render(*case) for name, case in CASES.items()}, indent=1, sort_keys=True)
    if os.environ.get("PAGODA_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.write_text(rendered + "\n")
    reviewed = SNAPSHOT.read_text().rstrip("\n")
    if rendered != reviewed:
        diff = "\n".join(
            difflib.unified_diff(reviewed.splitlines(), rendered.splitlines(), "reviewed", "now", lineterm="")
        )
        pytest.fail(f"the rendered objects changed (PAGODA_UPDATE_SNAPSHOTS=1 to accept):\n{diff[:6000]}")


def test_every_case_renders_every_kind_it_should() -> None:
    kinds = {name: [o["kind"] for o in _render(*case)] for name, case in CASES.items()}
    assert kinds["one GPU of eight, fp8, an image path, two API servers"] == [
        "Service",
        "PodDisruptionBudget",
        "Deployment",
    ]
    assert kinds["a whole node, bf16, a PVC, autoscaled, three API servers"] == [
        "Service", "PodDisruptionBudget", "Deployment", "HorizontalPodAutoscaler",
        # up to four replicas: a router in front (spec.router unset), its Service for the servers
        "Service", "ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget", "Deployment",
    ]  # fmt: skip
    assert kinds["a host path on a one-GPU node, fp16, three API servers"][-1] == "HTTPRoute"
    lora = "LoRA adapters from the model's claim, another claim, a node path and the Hub; prompt lookup"
    assert kinds[lora] == ["Service", "PodDisruptionBudget", "Deployment"]
    group = "405B bf16 over two whole nodes (a LeaderWorkerSet), an hf:// model in a cache volume, autoscaled"
    assert kinds[group] == ["Service", "PodDisruptionBudget", "LeaderWorkerSet", "HorizontalPodAutoscaler"]


def test_the_pods_run_as_the_images_user() -> None:
    dockerfile = (ROOT / "docker" / "server.Dockerfile").read_text()
    user = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.MULTILINE)
    assert user is not None
    for case in CASES.values():
        for pod in _server_pods(_render(*case)):
            security = pod["securityContext"]
            assert (security["runAsUser"], security["runAsGroup"]) == (int(user[1]), int(user[2]))
            assert security["runAsNonRoot"] is True


def test_the_model_is_mounted_read_only_whatever_its_source() -> None:
    for case in CASES.values():
        for pod in _server_pods(_render(*case)):
            mounts = pod["containers"][0]["volumeMounts"]
            model = [m for m in mounts if m["name"] == "model"]
            assert case[0]["model"]["source"].get("imagePath") or model, case[0]
            assert all(m["readOnly"] is True for m in model)
            adapters = [m for m in mounts if m["mountPath"].startswith("/adapters")]  # as the model is
            assert bool(adapters) == bool(case[0].get("adapters")), case[0]
            assert all(m["readOnly"] is True for m in adapters)


def test_a_partial_node_rolls_with_a_surge_and_a_whole_node_without() -> None:
    """A pod on part of a node can start its successor beside it (no capacity lost); a pod that takes
    the whole node cannot, so it gives its node up first."""
    strategies = {
        name: next(o for o in _render(*case) if o["kind"] == "Deployment")["spec"]["strategy"][
            "rollingUpdate"
        ]
        for name, case in CASES.items()
        if len(case) == 5  # a Deployment's
    }
    partial = strategies["one GPU of eight, fp8, an image path, two API servers"]
    assert partial == {"maxSurge": 1, "maxUnavailable": 0}
    assert strategies["a whole node, bf16, a PVC, autoscaled, three API servers"] == {
        "maxSurge": 0,
        "maxUnavailable": 1,
    }
