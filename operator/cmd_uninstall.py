"""`pagoda uninstall`: what the chart's pre-delete hook runs before `helm uninstall` removes the operator.

Helm removes what it installed (the operator, its RBAC) but not the InferenceServices users made, nor
what the operator made for them: without this, `helm uninstall` left every model server running with no
operator to reconcile or remove it. By default every InferenceService served is deleted in the
foreground (its Deployment and pods, Service, HPA, PDB and model cache go first, through owner
references) and the command waits until they are gone. With `--refuse` nothing is deleted: the command
lists what is left and exits 1, so the hook fails and `helm uninstall` stops with the operator still
running. `--keep-model-cache` first takes the cache PVCs out of their owners' hands, so that the next
install finds the weights.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import TextIO

from pagoda.operator.kube import Kube
from pagoda.operator.spec import GROUP, VERSION

HELP = "Delete every InferenceService and wait until its children are gone (the chart's pre-delete hook)."
CACHE_SELECTOR = "app.kubernetes.io/name=pagoda-model-cache,app.kubernetes.io/managed-by=pagoda-operator"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--namespace", action="append", default=[], help="a namespace served (repeatable); default: all"
    )
    parser.add_argument("--refuse", action="store_true", help="delete nothing: exit 1 while any is left")
    parser.add_argument("--keep-model-cache", action="store_true", help="orphan the cache PVCs: kept")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the deletions")


def _left(kube: Kube, namespaces: tuple[str, ...]) -> list[tuple[str, str]]:
    return [
        (item["metadata"]["namespace"], item["metadata"]["name"])
        for namespace in namespaces or (None,)
        for item in kube.list_inference_services(namespace)
    ]


def uninstall(
    kube: Kube,
    namespaces: tuple[str, ...] = (),
    refuse: bool = False,
    keep_model_cache: bool = False,
    timeout: float = 600.0,
    out: TextIO = sys.stdout,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    left = _left(kube, namespaces)
    names = ", ".join(f"{ns}/{name}" for ns, name in left)
    if not left:
        print("no InferenceService left", file=out)
        return 0
    if refuse:
        print(
            f"{len(left)} InferenceService(s) left: {names}. Delete them first (kubectl delete "
            "inferenceservices --all -A), or set uninstall.deleteInferenceServices=true.",
            file=out,
        )
        return 1
    if keep_model_cache:
        for namespace in sorted({ns for ns, _ in left}):
            for claim in kube.list_objects("v1", "PersistentVolumeClaim", namespace, CACHE_SELECTOR):
                name = claim["metadata"]["name"]
                kube.patch_metadata("v1", "PersistentVolumeClaim", namespace, name, {"ownerReferences": None})
                print(f"kept PersistentVolumeClaim {namespace}/{name} (model cache)", file=out)
    for namespace, name in left:
        kube.delete(f"{GROUP}/{VERSION}", "InferenceService", namespace, name, propagation="Foreground")
        print(f"deleting InferenceService {namespace}/{name} and its children", file=out)
    deadline = time.monotonic() + timeout
    while left := _left(kube, namespaces):
        if time.monotonic() > deadline:
            names = ", ".join(f"{ns}/{name}" for ns, name in left)
            print(f"still there after {timeout:.0f} s: {names}", file=out)
            return 1
        sleep(1.0)
    print("every InferenceService and its children are gone", file=out)
    return 0


def run(args: argparse.Namespace) -> int:
    return uninstall(
        Kube.from_environment(),
        tuple(args.namespace),
        refuse=args.refuse,
        keep_model_cache=args.keep_model_cache,
        timeout=args.timeout,
    )
