"""Autoscaling end to end, real parts only but DCGM: real server pods on the real node, scraped by a real
Prometheus through Kubernetes service discovery (the chart's PodMonitor, translated as
prometheus-operator does), prometheus-adapter serving custom.metrics.k8s.io with the chart's rules, and
the real HPA controller of kube-controller-manager (5 s sync) scaling the operator's Deployment.
dcgm-exporter is a test double (harness/dcgm_double.py); the chart's recording rule maps its labels.

One InferenceService (the embedded SmolLM2 on the CPU, one running sequence per pod, so a few concurrent
requests wait) serves the module; maxReplicas bounds it to two replicas.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from by_path import load_by_path

HERE = Path(__file__).resolve().parent
base = load_by_path("pagoda_e2e_test_real_pods_base", HERE / "test_real_pods.py")
dcgm = load_by_path("pagoda_e2e_harness_dcgm_double", HERE / "harness" / "dcgm_double.py")

# The first test's setup may bear the session's cold costs (real node build, images ~5-10 min, the
# metrics build ~4 min) on top of its own ~2 min: past pytest-timeout's default of 600 s.
pytestmark = pytest.mark.timeout(1800)

NAME = "scale"
QUEUE_METRIC = "pagoda_requests_waiting"
TARGET_QUEUE_DEPTH = 2
NUM_CLIENTS = 6  # one pod runs 1 and queues 5: past the target of 2, so the HPA wants ceil(5 / 2) = 3
IDLE_ACTIVITY, BUSY_ACTIVITY, TARGET_ACTIVITY = 0.2, 0.95, 0.5
CUSTOM = "/apis/custom.metrics.k8s.io/v1beta2"
# The dashboards' queries that need a GPU the e2e pods do not have: NVML finds none, so the server
# exports no pagoda_gpu_* series (service/metrics.py registers that collector only with a GPU).
NEEDS_NVML = re.compile(r"pagoda_gpu_(utilization_ratio|memory_used_bytes|memory_total_bytes)")


def _quantity(text: str) -> float:
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


@dataclass
class Timeline:
    """Samples, every two seconds, what the HPA sees: the adapter's per-pod queue depth (custom metrics
    API), the HPA's own current metrics, its desired and current replicas, and the Ready pods."""

    cluster: Any
    namespace: str
    rows: list[str] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    last: dict[str, Any] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)

    def sample(self) -> dict[str, Any]:
        path = f"{CUSTOM}/namespaces/{self.namespace}/pods/*/{QUEUE_METRIC}?" + urllib.parse.urlencode(
            {"labelSelector": f"app.kubernetes.io/instance={NAME}"}
        )
        raw = self.cluster.kubectl("get", "--raw", path, check=False)
        per_pod = (
            {
                i["describedObject"]["name"][-5:]: _quantity(i["value"])
                for i in json.loads(raw.stdout)["items"]
            }
            if raw.returncode == 0
            else {"error": raw.stderr.strip()[-80:]}
        )
        got = self.cluster.kubectl(
            "get", "hpa,deployment", NAME, "-n", self.namespace, "-o", "json", check=False
        )
        items = {i["kind"]: i for i in json.loads(got.stdout)["items"]} if got.returncode == 0 else {}
        hpa = items.get("HorizontalPodAutoscaler", {}).get("status", {})
        deployment = items.get("Deployment", {})
        seen = {
            m["pods"]["metric"]["name"]: _quantity(m["pods"]["current"]["averageValue"])
            for m in hpa.get("currentMetrics") or ()
            if m.get("type") == "Pods" and "current" in m.get("pods", {})
        }
        self.last = {
            "desired": hpa.get("desiredReplicas"),
            "current": hpa.get("currentReplicas"),
            "spec": deployment.get("spec", {}).get("replicas"),
            "ready": deployment.get("status", {}).get("readyReplicas", 0),
            "hpa_metrics": seen,
        }
        self.samples.append(self.last)
        self.rows.append(
            f"{time.monotonic() - self.t0:6.1f}s  adapter {QUEUE_METRIC} per pod {per_pod}  "
            f"HPA sees {seen}  desired {self.last['desired']} current {self.last['current']}  "
            f"deployment {self.last['spec']} ({self.last['ready']} Ready)"
        )
        return self.last

    def __str__(self) -> str:
        return "timeline:\n" + "\n".join(self.rows)


@dataclass
class ScalingService:
    cluster: Any
    namespace: str
    url: str
    timeline: Timeline
    pipeline: Any
    double: Any
    gpus: dict[str, str] = field(default_factory=dict)  # pod -> the fake GPU the device plugin gave it

    def hold_gpus(self, activity: float) -> None:
        """Tells the DCGM double which pod holds which GPU (the kubelet gave each pod one), at `activity`."""
        pods = {p["metadata"]["name"]: p for p in base.server_pods(self.cluster, self.namespace, NAME)}
        for name, pod in pods.items():
            running = (pod["status"].get("containerStatuses") or [{}])[0].get("state", {}).get("running")
            if name not in self.gpus and running:
                env = self.cluster.kubectl(
                    "exec", "-n", self.namespace, name, "--", "env", check=False
                ).stdout
                if found := re.search(r"^PAGODA_FAKE_GPU_IDS=fake-gpu-(\d+)$", env, re.MULTILINE):
                    self.gpus[name] = found.group(1)
        for name, gpu in list(self.gpus.items()):
            holder = dcgm.GpuHolder(self.namespace, name, "server", activity) if name in pods else None
            self.double.hold(gpu, holder)
            if holder is None:
                del self.gpus[name]

    def wait(self, what: str, done: Any, timeout: float, activity: float = IDLE_ACTIVITY) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.hold_gpus(activity)
            if done(self.timeline.sample()):
                return
            if time.monotonic() > deadline:
                hpa = self.cluster.kubectl("describe", "hpa", NAME, "-n", self.namespace, check=False).stdout
                raise AssertionError(
                    f"timed out after {timeout:.0f}s waiting for {what}\n{hpa}\n{self.timeline}"
                )
            time.sleep(2)


@pytest.fixture(scope="module")
def operator(cluster, metrics_pipeline, tmp_path_factory) -> Iterator[Any]:
    """The chart installed and `pagoda operator` on the host (as in test_real_pods.py), serving its
    metrics, which Prometheus scrapes as a static target (no pod to discover: it is a host process)."""
    port = _free_port()
    with base.host_operator(cluster, tmp_path_factory.mktemp("operator"), f"--metrics-port={port}") as host:
        labels = {"namespace": base.RELEASE_NS, "pod": "pagoda-operator-on-the-host", "container": "operator"}
        metrics_pipeline.add_target("pagoda-operator", f"127.0.0.1:{port}", labels)
        yield host


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def service(cluster, real_node, real_images, metrics_pipeline, operator) -> Iterator[ScalingService]:
    namespace = f"e2e-scale-{int(time.time()) % 100000}"
    cluster.kubectl("create", "namespace", namespace)
    double = dcgm.DcgmExporterDouble()
    # As kube-prometheus-stack scrapes the GPU operator's dcgm-exporter: the exporter pod's own labels
    # are target labels, so the GPU's pod labels arrive as exported_namespace/exported_pod.
    exporter = {
        "namespace": "gpu-operator",
        "pod": "nvidia-dcgm-exporter-7xk2p",
        "container": "dcgm-exporter",
    }
    metrics_pipeline.add_target("dcgm-exporter", double.address, exporter | {"service": "dcgm-exporter"})
    try:
        isvc = base.inference_service(NAME, real_images["server"])
        isvc["spec"]["engine"] = {"maxNumSeqs": 1}
        isvc["spec"]["autoscaling"] = {
            "minReplicas": 1,
            "maxReplicas": 2,
            "targetQueueDepth": TARGET_QUEUE_DEPTH,
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 15}},  # the default is 300 s
        }
        isvc["spec"]["router"] = {"enabled": True, "replicas": 1}  # the dashboard's Router row
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(isvc))
        base.ready_service(cluster, namespace, NAME, operator)
        base.wait_for(
            "the Service on the router", lambda: base.service_on_router(cluster, namespace, NAME), 180
        )
        url = base.service_url(cluster, namespace, NAME)
        yield ScalingService(cluster, namespace, url, Timeline(cluster, namespace), metrics_pipeline, double)
    finally:
        double.stop()
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        cluster.kubectl(
            "delete", "pods", "--all", "-n", namespace, "--grace-period=0", "--force", check=False
        )


def _load_until(url: str, stop: threading.Event, errors: list[str]) -> None:
    body = {"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    while not stop.is_set():
        req = urllib.request.Request(
            f"{url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                r.read()
        except OSError as e:
            errors.append(str(e))
            time.sleep(1)


def test_queue_depth_scales_up_and_back_down(service: ScalingService) -> None:
    s = service
    s.wait("the HPA to read the queue depth", lambda last: QUEUE_METRIC in last["hpa_metrics"], 120)
    assert s.timeline.last["spec"] == 1
    stop, errors = threading.Event(), []
    clients = [threading.Thread(target=_load_until, args=(s.url, stop, errors)) for _ in range(NUM_CLIENTS)]
    for c in clients:
        c.start()
    try:
        s.wait("the HPA to scale the Deployment up to 2 Ready pods", lambda last: last["ready"] == 2, 300)
    finally:
        stop.set()
    # Each client's request still queued on the first pod finishes (max-num-seqs 1: one at a time).
    s.wait("the clients' last requests", lambda last: not any(c.is_alive() for c in clients), 150)
    s.wait("the HPA to scale back down to 1", lambda last: last["spec"] == 1 and last["current"] == 1, 240)
    print(s.timeline)
    peak = max(row["hpa_metrics"].get(QUEUE_METRIC, 0.0) for row in s.timeline.samples)
    assert peak > TARGET_QUEUE_DEPTH, s.timeline
    assert not errors, f"{len(errors)} requests failed: {errors[:3]}\n{s.timeline}"


def test_gpu_activity_from_dcgm_scales_up(service: ScalingService) -> None:
    """The DCGM double reports the pod's GPU 95% busy; with a 50% target the HPA wants two replicas."""
    s = service
    patch = {"spec": {"autoscaling": {"targetQueueDepth": 100, "targetGpuActivity": TARGET_ACTIVITY}}}
    s.cluster.kubectl(
        "patch", "inferenceservice", NAME, "-n", s.namespace, "--type=merge", "-p", json.dumps(patch)
    )
    s.wait(
        "the HPA to scale up on DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        lambda last: (
            last["hpa_metrics"].get("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 0) > TARGET_ACTIVITY
            and last["desired"] == 2
            and last["spec"] == 2
        ),
        180,
        activity=BUSY_ACTIVITY,
    )
    print(s.timeline)
    recorded = s.pipeline.query(
        f'namespace_pod:DCGM_FI_PROF_GR_ENGINE_ACTIVE:avg{{namespace="{s.namespace}"}}'
    )
    assert recorded and all(r["metric"]["pod"].startswith(f"{NAME}-") for r in recorded), recorded


def test_every_dashboard_and_adapter_query_returns_data(service: ScalingService) -> None:
    """Each dashboard expression (Grafana's variables filled in) and each adapter rule's metricsQuery (its
    template filled in as the adapter fills it) returns at least one series from the e2e Prometheus."""
    s = service
    for _ in range(4):  # data of its own, whatever ran before
        base.ask(s.url, timeout=120)
    try:  # and one error, so that the router's error series exists (a counter appears with its first)
        base.ask(s.url, timeout=120, model="no-such-model")
    except urllib.error.HTTPError as e:
        assert e.code == 404, e  # the server's answer, passed on by the router
    else:
        raise AssertionError("a request for a model the service does not serve was answered")
    s.hold_gpus(IDLE_ACTIVITY)
    time.sleep(8)  # two scrapes and a rule evaluation
    queries = {**_dashboard_queries(s.namespace), **_adapter_queries(s.namespace, s.pipeline)}
    assert len(queries) > 10
    empty, skipped = [], []
    for where, expr in queries.items():
        if NEEDS_NVML.search(expr):
            skipped.append(where)
            assert not s.pipeline.query(expr), f"{where}: GPU series on a CPU pod?"
        elif not s.pipeline.query(expr):
            empty.append(f"{where}: {expr}")
    print(f"{len(queries) - len(skipped)} queries returned data; no GPU (NVML) for: {skipped}")
    assert not empty, "queries that returned nothing:\n" + "\n".join(empty)


def _dashboard_queries(namespace: str) -> dict[str, str]:
    variables = {"$namespace": namespace, "$pod": ".*", "$__rate_interval": "5m"}
    found = {}
    for path in sorted((HERE.parent / "charts" / "pagoda" / "dashboards").glob("*.json")):
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"]
                for var, value in variables.items():
                    expr = expr.replace(var, value)
                found[f"{path.name} / {panel['title']} / {target['refId']}"] = expr
        for var in dashboard["templating"]["list"]:
            if var["type"] == "query":  # label_values(<series selector>, <label>): the series must exist
                selector = re.fullmatch(r"label_values\((.*),\s*\w+\)", var["query"])
                assert selector, var["query"]
                expr = selector.group(1).replace("$namespace", namespace)
                found[f"{path.name} / variable {var['name']}"] = f"count({expr})"
    return found


def _adapter_queries(namespace: str, pipeline: Any) -> dict[str, str]:
    """metricsQuery as prometheus-adapter renders it for the HPA's request: <<.Series>> the series name,
    <<.LabelMatchers>> namespace and pod matchers, <<.GroupBy>> the pod label."""
    import yaml

    rules = yaml.safe_load((pipeline.targets_dir.parent / "adapter-rules.yaml").read_text())["rules"]
    found = {}
    for rule in rules:
        series = re.match(r"[^{]+", rule["seriesQuery"]).group(0)  # type: ignore[union-attr]
        expr = (
            rule["metricsQuery"]
            .replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", f'namespace="{namespace}",pod=~"{NAME}-.*"')
            .replace("<<.GroupBy>>", "pod")
        )
        found[f"adapter rule {rule['name']['as']}"] = expr
    return found
