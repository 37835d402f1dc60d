"""The e2e cluster itself: GPU scheduling on the simulated nodes, RBAC and tokens, teardown."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest


def wait_for(what: str, check: Callable[[], object], timeout: float = 90.0) -> object:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.5)


def gpu_deployment(name: str, product: str, gpus: int, replicas: int = 1) -> str:
    return json.dumps({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [
                            {"key": "nvidia.com/gpu.product", "operator": "In", "values": [product]},
                        ]}],
                    }}},
                    "containers": [{
                        "name": "server",
                        "image": "registry.invalid/pagoda/fake:0",
                        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                    }],
                },
            },
        },
    })  # fmt: skip


def pods(cluster, namespace: str, app: str) -> list[dict]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", f"app={app}", "-o", "json").stdout
    return json.loads(out)["items"]


def is_ready(pod: dict) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return pod["status"].get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in conditions
    )


def test_nodes_carry_gfd_labels_and_gpus(cluster, gpu_catalogue):
    items = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    by_name = {n["metadata"]["name"]: n for n in items}
    for entry in gpu_catalogue["nodes"]:
        node = by_name[entry["name"]]
        labels = node["metadata"]["labels"]
        if not entry.get("product"):
            assert "nvidia.com/gpu.present" not in labels
            assert "nvidia.com/gpu" not in node["status"]["allocatable"]
            continue
        gpu = gpu_catalogue["gpus"][entry["product"]]
        assert labels["nvidia.com/gpu.present"] == "true"
        assert labels["nvidia.com/gpu.product"] == entry["product"]
        assert labels["nvidia.com/gpu.family"] == gpu["family"]
        assert (
            f"{labels['nvidia.com/gpu.compute.major']}.{labels['nvidia.com/gpu.compute.minor']}"
            == gpu["compute"]
        )
        assert labels["nvidia.com/gpu.memory"] == gpu["memory"]
        assert labels["nvidia.com/gpu.count"] == str(entry["gpus"])
        # kwok keeps what the "device plugin" advertised.
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(entry["gpus"])
        assert node["status"]["capacity"]["nvidia.com/gpu"] == str(entry["gpus"])
    assert by_name["gpu-h200-0"]["metadata"]["labels"]["nvidia.com/gpu.memory"] == "143771"


def test_gpu_deployment_lands_on_the_requested_product(cluster, namespace):
    name = "llm"
    cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=gpu_deployment(name, "NVIDIA-H100-80GB-HBM3", 2, 2)
    )
    cluster.kubectl("rollout", "status", "-n", namespace, f"deployment/{name}", "--timeout=90s")
    running = pods(cluster, namespace, name)
    assert len(running) == 2
    for pod in running:
        assert pod["spec"]["nodeName"] == "gpu-h100-0"
        assert is_ready(pod), pod["status"]
        assert pod["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "2"


def test_too_many_gpus_stays_pending_with_the_schedulers_reason(cluster, namespace):
    name = "too-big"
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=gpu_deployment(name, "NVIDIA-H200", 16))
    pod = wait_for("the pod", lambda: pods(cluster, namespace, name))[0]

    def failed_scheduling() -> list[dict]:
        out = cluster.kubectl(
            "get", "events", "-n", namespace, "-o", "json",
            "--field-selector", f"reason=FailedScheduling,involvedObject.name={pod['metadata']['name']}",
        ).stdout  # fmt: skip
        return json.loads(out)["items"]

    events = wait_for("a FailedScheduling event", failed_scheduling)
    assert "Insufficient nvidia.com/gpu" in events[0]["message"], events[0]["message"]
    pod = pods(cluster, namespace, name)[0]
    assert pod["status"]["phase"] == "Pending"
    assert "nodeName" not in pod["spec"]
    scheduled = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert scheduled and scheduled[0]["status"] == "False" and scheduled[0]["reason"] == "Unschedulable"


def test_serviceaccount_tokens_and_rbac(cluster, namespace):
    cluster.kubectl("create", "serviceaccount", "robot", "-n", namespace)
    robot = cluster.serviceaccount_kubeconfig(namespace, "robot", duration="10m")

    def as_robot(*args: str) -> subprocess.CompletedProcess:
        return cluster.kubectl("--kubeconfig", str(robot), *args, check=False)

    whoami = as_robot("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}")
    assert whoami.stdout == f"system:serviceaccount:{namespace}:robot", whoami.stderr
    denied = as_robot("get", "pods")
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr
    cluster.kubectl("create", "rolebinding", "robot-view", "-n", namespace, "--clusterrole=view",
                    f"--serviceaccount={namespace}:robot")  # fmt: skip
    wait_for("RBAC to allow the robot", lambda: as_robot("get", "pods").returncode == 0)
    assert as_robot("get", "pods", "-n", "kube-system").returncode != 0
    # Reached as an existing cluster (no workdir), the kubeconfig lands in the temp folder, and goes
    # when the session's fixture calls remove_scratch.
    existing = type(cluster)(kubeconfig=cluster.kubeconfig, bin_dir=cluster.bin_dir)
    scratch = existing.serviceaccount_kubeconfig(namespace, "robot", duration="10m")
    assert scratch.exists() and scratch.parent == Path(tempfile.gettempdir()), scratch
    existing.remove_scratch()
    assert not scratch.exists() and existing.scratch == []


def test_aggregation_layer_is_configured(cluster):
    name = "extension-apiserver-authentication"
    cm = json.loads(cluster.kubectl("get", "configmap", "-n", "kube-system", name, "-o", "json").stdout)
    assert "requestheader-client-ca-file" in cm["data"]
    assert json.loads(cm["data"]["requestheader-allowed-names"]) == ["front-proxy-client"]


def test_hpa_controller_runs(cluster, namespace):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=gpu_deployment("scaled", "NVIDIA-L40S", 1))
    cluster.kubectl("autoscale", "-n", namespace, "deployment/scaled", "--min=1", "--max=3", "--cpu=50%")

    def conditions() -> list[dict]:
        hpa = json.loads(cluster.kubectl("get", "hpa", "-n", namespace, "scaled", "-o", "json").stdout)
        return hpa.get("status", {}).get("conditions", [])

    # No metrics API is installed, so the controller reports that it cannot get metrics: proof it ran.
    got = wait_for("the HPA controller to act", conditions, timeout=60)
    assert any(c["type"] == "AbleToScale" for c in got), got


def test_teardown_leaves_no_process(cluster, cluster_harness, tmp_path):
    if cluster.workdir is None:
        pytest.skip("uses an existing cluster (PAGODA_E2E_KUBECONFIG)")
    catalogue = tmp_path / "nodes.yaml"
    catalogue.write_text(
        "gpus:\n  Tesla-T4: {family: turing, compute: '7.5', memory: '15360'}\n"
        "nodes:\n  - {name: gpu-t4-0, product: Tesla-T4, gpus: 1, cpu: '16', memory: 64Gi}\n"
    )
    workdir = tmp_path / "cluster"
    try:
        other = cluster_harness.start(workdir, cluster.bin_dir, catalogue=catalogue)
        assert other.kubeconfig != cluster.kubeconfig
        assert other.kubectl("get", "nodes", "-o", "name").stdout.split() == ["node/gpu-t4-0"]
        assert len(cluster_harness.leftover_pids(workdir)) == 5
    finally:
        cluster_harness.stop(workdir)
    mine = str(workdir.resolve())
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().decode(errors="replace")
        except OSError:
            continue
        if mine in text and cmdline.parent.name != str(os.getpid()):
            left.append(f"{cmdline.parent.name}: {text[:120]}")
    assert left == [], f"processes of the stopped cluster still running: {left}"
    # The session's cluster is untouched.
    cluster.kubectl("get", "--raw", "/readyz")


def test_helm_installs_and_waits(cluster, namespace, tmp_path):
    def helm(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["helm", *args], env=cluster.env, capture_output=True, text=True, timeout=180)

    version = helm("version", "--short")
    assert version.returncode == 0 and version.stdout.startswith("v3."), version.stderr
    created = helm("create", str(tmp_path / "demo"))
    assert created.returncode == 0, created.stderr
    installed = helm("install", "demo", str(tmp_path / "demo"), "-n", namespace, "--wait", "--timeout=90s")
    assert installed.returncode == 0, installed.stderr
    out = cluster.kubectl("get", "pods", "-n", namespace, "-l", "app.kubernetes.io/name=demo", "-o", "json")
    items = json.loads(out.stdout)["items"]
    assert items and all(is_ready(p) for p in items)


def test_jobs_complete(cluster, namespace):
    # kwok's pod-complete stage: pods owned by a Job succeed, so Jobs (and Helm hook Jobs) finish.
    cluster.kubectl("create", "job", "once", "-n", namespace, "--image=registry.invalid/pagoda/fake:0")
    cluster.kubectl("wait", "-n", namespace, "--for=condition=Complete", "job/once", "--timeout=60s")
