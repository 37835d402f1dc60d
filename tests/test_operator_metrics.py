"""The operator's metrics: Reconciler.run against an in-memory API, read back as Prometheus scrapes them.

Values are read from the text exposition (generate_latest, or a real HTTP scrape on loopback) with
prometheus_client's own parser; docs/metrics.md's operator table is held to what is exported.
"""

from __future__ import annotations

import copy
import re
import urllib.request
from pathlib import Path
from typing import Any

import kopf
import pytest
from fake_kube import FakeKube
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.operator import cmd_operator
from pagoda.operator.handlers import Reconciler
from pagoda.operator.kube import KubeError
from pagoda.operator.metrics import OperatorMetrics, new_registry, serve
from pagoda.operator.spec import OperatorConfig

ROOT = Path(__file__).resolve().parents[1]
H100 = {
    "metadata": {
        "name": "h100",
        "labels": {
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            "nvidia.com/gpu.compute.major": "9",
            "nvidia.com/gpu.compute.minor": "0",
            "nvidia.com/gpu.memory": "81559",
            "nvidia.com/gpu.count": "8",
        },
    },
    "status": {"allocatable": {"nvidia.com/gpu": "8"}},
}


def inference_service(name: str, **spec: Any) -> dict:
    base = {"model": {"name": "llama-3.1-8b", "source": {"imagePath": "/models/llama"}}}
    return {
        "apiVersion": "serving.pagoda.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "generation": 1},
        "spec": base | spec,
    }


@pytest.fixture(autouse=True)
def no_kopf_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """kopf.event needs a running operator's event queue; the events themselves are tested elsewhere."""
    monkeypatch.setattr(kopf, "event", lambda *args, **kwargs: None)


def scrape(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    """(sample name, its labels) -> value, as Prometheus would read the exposition."""
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def reconciler(kube: FakeKube) -> tuple[Reconciler, CollectorRegistry]:
    registry = CollectorRegistry()
    return Reconciler(kube, OperatorConfig(), OperatorMetrics(registry)), registry  # type: ignore[arg-type]


def test_reconciles_are_counted_by_result_timed_and_errors_by_kind() -> None:
    kube = FakeKube([H100])
    rec, registry = reconciler(kube)
    ok = inference_service("ok")
    rec.run(ok)
    rec.run(ok)
    rec.run(inference_service("unknown", model={"name": "mystery-model", "source": {"imagePath": "/m"}}))
    kube.objects[("Service", "ns", "theirs")] = {"metadata": {"name": "theirs"}}  # no owner reference
    rec.run(inference_service("theirs"))

    kube.refuse[("PodDisruptionBudget", False)] = KubeError(500, "PATCH", "/x", {"message": "etcd timeout"})
    with pytest.raises(kopf.TemporaryError):  # kopf retries it; still a result, not an error
        rec.run(inference_service("retried"))
    kube.refuse.clear()

    kube.fail["patch_status"] = KubeError(409, "PATCH", "/x", {"message": "conflict"})
    with pytest.raises(KubeError):
        rec.run(inference_service("api-error"))
    kube.fail = {"list_nodes": RuntimeError("a bug")}
    with pytest.raises(RuntimeError):
        rec.run(inference_service("bug"))

    samples = scrape(registry)
    reconciles = {
        r: value(samples, "pagoda_operator_reconciles_total", result=r)
        for r in ("ok", "invalid_spec", "apply_failed", "conflict", "error")
    }
    assert reconciles == {"ok": 2, "invalid_spec": 1, "apply_failed": 1, "conflict": 1, "error": 2}
    errors = {
        e: value(samples, "pagoda_operator_reconcile_errors_total", error=e) for e in ("api", "internal")
    }
    assert errors == {"api": 1, "internal": 1}
    assert value(samples, "pagoda_operator_reconcile_errors_total", error="connection") == 0
    # Every reconcile is timed, those that raised too; the buckets are cumulative up to +Inf.
    assert value(samples, "pagoda_operator_reconcile_duration_seconds_count") == 7
    assert value(samples, "pagoda_operator_reconcile_duration_seconds_bucket", le="+Inf") == 7
    assert 0 < value(samples, "pagoda_operator_reconcile_duration_seconds_sum") < 7 * 30  # type: ignore[operator]


def test_service_gauges_follow_each_objects_last_reconcile_and_forget_deleted_ones() -> None:
    t4 = copy.deepcopy(H100)
    t4["metadata"]["name"] = "t4"
    t4["metadata"]["labels"] |= {
        "nvidia.com/gpu.product": "Tesla-T4",
        "nvidia.com/gpu.compute.major": "7",
        "nvidia.com/gpu.compute.minor": "5",
        "nvidia.com/gpu.memory": "15360",
        "nvidia.com/gpu.count": "1",
    }
    t4["status"]["allocatable"]["nvidia.com/gpu"] = "1"
    kube = FakeKube([H100, t4])
    rec, registry = reconciler(kube)
    a, b = (
        inference_service("a"),
        inference_service("b", model={"name": "llama-3.2-1b", "source": {"imagePath": "/m"}}),
    )
    on_t4 = inference_service("small", gpuPreferences=[{"product": "T4"}])  # 8B fp16 does not fit one T4
    for body in (a, a, b, on_t4, on_t4):  # a second reconcile of one object counts it once
        rec.run(body)

    samples = scrape(registry)
    h100 = {"gpu_product": "NVIDIA-H100-80GB-HBM3", "tensor_parallel": "1"}
    assert value(samples, "pagoda_operator_profile_services", **h100, precision="fp8") == 2
    profiles = [labels for name, labels in samples if name == "pagoda_operator_profile_services"]
    assert len(profiles) == 1  # the service without a fitting GPU has no profile
    no_fit = {dict(k)["reason"]: v for (n, k), v in samples.items() if n.endswith("no_fitting_gpu_services")}
    assert no_fit == {
        "NoGpuNodes": 0,
        "NoPreferredGpu": 0,
        "ComputeCapability": 0,
        "TensorParallel": 0,
        "Memory": 1,
        "Capacity": 0,
    }
    ready = {
        tuple(dict(k)[x] for x in ("ready", "reason")): v
        for (n, k), v in samples.items()
        if n == "pagoda_operator_inference_services"
    }
    assert ready == {("False", "ReplicasNotReady"): 2, ("False", "NoProfile"): 1}

    # The Deployment of `a` becomes ready; `b` and `small` are deleted.
    deployment = kube.objects[("Deployment", "ns", "a")]
    deployment["status"] = {
        "observedGeneration": 1,
        "replicas": 1,
        "updatedReplicas": 1,
        "readyReplicas": 1,
        "availableReplicas": 1,
    }
    rec.run(a)
    rec.forget("uid-b")
    rec.forget("uid-small")
    samples = scrape(registry)
    assert value(samples, "pagoda_operator_profile_services", **h100, precision="fp8") == 1
    assert value(samples, "pagoda_operator_no_fitting_gpu_services", reason="Memory") == 0
    ready = {k: v for (n, k), v in samples.items() if n == "pagoda_operator_inference_services"}
    assert ready == {frozenset({"ready": "True", "reason": "ReplicasReady"}.items()): 1}


def test_an_object_deleted_during_its_reconcile_leaves_no_gauge() -> None:
    kube = FakeKube([H100])
    rec, registry = reconciler(kube)
    kube.fail["patch_status"] = KubeError(404, "PATCH", "/x", {"message": "not found"})
    rec.run(inference_service("gone"))
    samples = scrape(registry)
    assert value(samples, "pagoda_operator_reconciles_total", result="ok") == 1
    assert not [
        k
        for k in samples
        if k[0] in ("pagoda_operator_profile_services", "pagoda_operator_inference_services")
    ]


def test_served_over_http_on_loopback() -> None:
    registry = new_registry()
    rec = Reconciler(FakeKube([H100]), OperatorConfig(), OperatorMetrics(registry))  # type: ignore[arg-type]
    rec.run(inference_service("a"))
    port = serve(registry, 0, "127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    assert 'pagoda_operator_reconciles_total{result="ok"} 1.0' in text
    assert "process_resident_memory_bytes" in text  # the process series of a default registry
    assert re.search(r'python_info\{.*implementation="CPython"', text)


def _documented() -> dict[str, tuple[str, set[str]]]:
    """name -> (type, label names) from docs/metrics.md's operator section."""
    doc = (ROOT / "docs" / "metrics.md").read_text()
    section = doc.split("## The operator", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| ([a-z]+) \|([^|]*)\|", section, re.M)
    return {name: (kind, set(re.findall(r"`([a-z_]+)`", labels))) for name, kind, labels in rows}


def test_docs_list_exactly_what_is_exported() -> None:
    registry = CollectorRegistry()
    OperatorMetrics(registry)
    text = generate_latest(registry).decode()
    exported = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        exported[name] = (family.type, labels)
    documented = _documented()
    assert set(documented) == set(exported)
    for name, (kind, labels) in documented.items():
        assert exported[name][0] == kind, name
        assert labels >= exported[name][1], name  # gauges built at scrape time have no samples yet
    assert documented["pagoda_operator_profile_services"][1] == {
        "gpu_product",
        "precision",
        "tensor_parallel",
    }


def test_metrics_port_flag_defaults_off_and_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    def parse(*argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        cmd_operator.add_arguments(parser)
        return parser.parse_args(argv)

    assert parse().metrics_port == 0
    assert parse("--metrics-port", "8081").metrics_port == 8081
    monkeypatch.setenv("PAGODA_OPERATOR_METRICS_PORT", "9100")
    assert parse().metrics_port == 9100
    with pytest.raises(SystemExit):
        parse("--metrics-port", "70000")


def test_a_taken_metrics_port_is_a_clear_error() -> None:
    import socket

    from pagoda.operator import metrics

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(metrics.MetricsPortError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            metrics.serve(metrics.new_registry(), port, "127.0.0.1")
