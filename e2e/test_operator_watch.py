"""Node changes reach the operator through its node watch, not its periodic re-check: here the re-check
is 10 minutes away, and a new GPU node is still used within seconds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from by_path import load_by_path

base = load_by_path("pagoda_e2e_test_operator_base", Path(__file__).with_name("test_operator.py"))
RESYNC_SECONDS = 600  # far beyond this test: only the watch can be what noticed the node


@pytest.fixture(scope="module")
def slow_resync_operator(cluster, tmp_path_factory) -> Iterator[object]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    with base.running_operator(cluster, log, resync_seconds=RESYNC_SECONDS) as op:
        yield op


def test_a_new_gpu_node_is_seen_through_the_watch(
    cluster, namespace, slow_resync_operator, cluster_harness
) -> None:
    op = slow_resync_operator
    base.apply(cluster, namespace, base.small_service("watcher", gpuPreferences=[{"product": "B200"}]))

    def no_gpu() -> dict | None:
        isvc = base.get(cluster, namespace, "inferenceservice", "watcher")
        return isvc if base.condition(isvc, "ProfileSelected") == "False" else None

    base.wait_for("ProfileSelected=False", no_gpu, context=op.tail)
    gpus = {"NVIDIA-B200": {"family": "blackwell", "compute": "10.0", "memory": "183359"}}
    entry = {"name": "gpu-b200-watch", "product": "NVIDIA-B200", "gpus": 8, "cpu": "224", "memory": "2Ti"}
    node = cluster_harness.nodes.node_manifest(entry, gpus)
    start = time.monotonic()
    cluster.kubectl("create", "-f", "-", input=json.dumps(node))
    try:
        isvc = base.ready_service(cluster, namespace, "watcher", op, timeout=60)
        took = time.monotonic() - start
        assert isvc["status"]["profile"]["gpu"]["product"] == "NVIDIA-B200"
        assert took < RESYNC_SECONDS / 2, took
    finally:
        cluster.kubectl(
            "delete", "pis", "--all", "-n", namespace, "--wait=true", "--timeout=60s", check=False
        )
        cluster.kubectl("delete", "node", "gpu-b200-watch", "--wait=false", check=False)
