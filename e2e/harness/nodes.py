"""The simulated GPU nodes of e2e/gpu_nodes.yaml as Kubernetes Node objects (pure functions)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

CATALOGUE = Path(__file__).resolve().parent.parent / "gpu_nodes.yaml"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"


def load_catalogue(path: Path = CATALOGUE) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    for node in data["nodes"]:
        product = node.get("product")
        if product is not None and product not in data["gpus"]:
            raise ValueError(f"{path}: node {node['name']} has unknown product {product!r}")
    return data


def gfd_labels(product: str, gpu: dict[str, str], count: int) -> dict[str, str]:
    """The labels GPU Feature Discovery puts on a node with `count` GPUs of `product`."""
    major, minor = gpu["compute"].split(".")
    return {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.family": gpu["family"],
        "nvidia.com/gpu.compute.major": major,
        "nvidia.com/gpu.compute.minor": minor,
        "nvidia.com/gpu.memory": gpu["memory"],
        "nvidia.com/gpu.count": str(count),
    }


def node_manifest(entry: dict[str, Any], gpus: dict[str, dict[str, str]]) -> dict[str, Any]:
    name = entry["name"]
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
    }
    resources = {
        "cpu": str(entry["cpu"]),
        "memory": str(entry["memory"]),
        "pods": str(entry.get("pods", 110)),
        "ephemeral-storage": "1Ti",
    }
    if entry.get("product"):
        labels |= gfd_labels(entry["product"], gpus[entry["product"]], int(entry["gpus"]))
        resources["nvidia.com/gpu"] = str(entry["gpus"])
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"taints": entry.get("taints", [])},
        "status": {
            "capacity": resources,
            "allocatable": dict(resources),
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": "fake",
                "kubeProxyVersion": "fake",
                "containerRuntimeVersion": "fake",
                "kernelVersion": "fake",
                "osImage": "fake",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        },
    }


def node_manifests(path: Path = CATALOGUE) -> list[dict[str, Any]]:
    data = load_catalogue(path)
    return [node_manifest(n, data["gpus"]) for n in data["nodes"]]


if __name__ == "__main__":  # `python e2e/harness/nodes.py | kubectl create -f -` (e2e/kind/up.sh)
    import json

    print(json.dumps({"apiVersion": "v1", "kind": "List", "items": node_manifests()}, indent=1))
