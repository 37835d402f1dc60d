"""The Grafana dashboards ask for exactly the series the server exports, and the chart ships them.

docs/metrics.md lists what `pagoda serve` and `pagoda operator` export (tests/test_serve_http.py and
tests/test_operator_metrics.py hold them to it); here every series a dashboard queries must be in that
list, histograms queried through `_bucket`.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = sorted((ROOT / "charts" / "pagoda" / "dashboards").glob("*.json"))


def documented() -> dict[str, str]:
    """metric name -> type, from docs/metrics.md's tables."""
    rows = re.findall(r"^\| `([^`]+)` \| ([a-z]+)", (ROOT / "docs" / "metrics.md").read_text(), re.M)
    return dict(rows)


def queried(dashboard: dict) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return {m for e in exprs for m in re.findall(r"\b(?:pagoda_|vllm:|vllm_router_|http_)[a-z0-9_]+", e)}


def test_every_queried_series_is_exported() -> None:
    assert DASHBOARDS, "no dashboards in charts/pagoda/dashboards"
    metrics = documented()
    assert "pagoda_requests_waiting" in metrics  # the parser reads the tables
    for path in DASHBOARDS:
        for name in queried(json.loads(path.read_text())):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if base != name:
                assert metrics.get(base) == "histogram", f"{path.name}: {name} is not a histogram's series"
            else:
                assert name in metrics, f"{path.name} queries {name}, which the server does not export"


def test_the_dashboard_shows_the_scaling_signals_and_latencies() -> None:
    names = {
        re.sub(r"_(bucket|sum|count)$", "", n) for p in DASHBOARDS for n in queried(json.loads(p.read_text()))
    }
    assert {
        "pagoda_requests_waiting",
        "pagoda_kv_cache_usage_ratio",
        "pagoda_time_to_first_token_seconds",
        "pagoda_inter_token_latency_seconds",
        "pagoda_generation_tokens_total",
        "http_requests_total",
    } <= names


def test_the_operator_row_shows_reconciles_errors_latency_and_profiles() -> None:
    """Its panels read the operator's own series only, across namespaces: the $namespace and $pod
    variables pick server pods, and the operator runs elsewhere."""
    (dashboard,) = [json.loads(p.read_text()) for p in DASHBOARDS if p.name == "pagoda-serving.json"]
    panels = dashboard["panels"]
    (row,) = [i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == "Operator"]
    below = panels[row + 1 :]
    exprs = [t["expr"] for p in below for t in p["targets"]]
    names = queried({"panels": below, "templating": {"list": []}})
    assert {re.sub(r"_(bucket|sum|count)$", "", n) for n in names} == {
        "pagoda_operator_reconciles_total",
        "pagoda_operator_reconcile_errors_total",
        "pagoda_operator_reconcile_duration_seconds",
        "pagoda_operator_profile_services",
        "pagoda_operator_no_fitting_gpu_services",
        "pagoda_operator_inference_services",
    }
    assert not [e for e in exprs if "$namespace" in e or "$pod" in e]
    for quantile in ("0.5", "0.99"):
        assert any(f"histogram_quantile({quantile}, " in e for e in exprs)
    assert any("by (gpu_product" in e for e in exprs)
    assert [p["id"] for p in panels] == sorted({p["id"] for p in panels})  # unique ids, in order
    assert all(p["gridPos"]["y"] > panels[row]["gridPos"]["y"] for p in below)


def test_the_router_row_shows_decisions_spread_load_and_errors_per_namespace() -> None:
    """Between the servers' panels and the operator's: vllm-router's series, picked by $namespace (the
    router pods are in the service's namespace; $pod names server pods, so it is not used)."""
    (dashboard,) = [json.loads(p.read_text()) for p in DASHBOARDS if p.name == "pagoda-serving.json"]
    panels = dashboard["panels"]
    rows = [i for i, p in enumerate(panels) if p["type"] == "row"]
    (router,) = [i for i in rows if panels[i]["title"] == "Router"]
    below = panels[router + 1 : min(i for i in rows if i > router)]
    exprs = [t["expr"] for p in below for t in p["targets"]]
    assert queried({"panels": below, "templating": {"list": []}}) == {
        "vllm_router_prefix_routing_decisions_total",
        "vllm_router_processed_requests_total",
        "vllm_router_running_requests",
        "vllm_router_worker_health",
        "vllm_router_generate_duration_seconds_bucket",
        "vllm_router_request_errors_total",
    }
    assert all('namespace=~"$namespace"' in e and "$pod" not in e for e in exprs)
    assert any("by (outcome)" in e for e in exprs) and any("by (worker)" in e for e in exprs)
    layout = [(p["gridPos"]["x"], p["gridPos"]["y"], p["gridPos"]["w"], p["gridPos"]["h"]) for p in panels]
    cells = {(x + dx, y + dy) for x, y, w, h in layout for dx in range(w) for dy in range(h)}
    assert len(cells) == sum(w * h for _, _, w, h in layout)  # no two panels overlap


def _helm() -> str:
    cached = glob.glob(os.path.expanduser("~/.cache/pagoda/k8s/*/bin/helm"))
    found = os.environ.get("PAGODA_K8S_BIN", "") and os.path.join(os.environ["PAGODA_K8S_BIN"], "helm")
    helm = found or (cached[0] if cached else shutil.which("helm"))
    if not helm:  # as tests/test_chart.py: listed loudly at the end outside CI, a failure under CI
        pytest.skip("no helm binary (run e2e/tools/build.sh)")
    return helm


def render(*args: str) -> list[dict]:
    out = subprocess.run(
        [_helm(), "template", "pagoda", str(ROOT / "charts" / "pagoda"), "--namespace", "mon", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [
        d
        for d in yaml.safe_load_all(out)
        if d and d["kind"] == "ConfigMap" and "dashboards" in d["metadata"]["name"]
    ]


def test_chart_ships_them_for_grafanas_sidecar() -> None:
    (configmap,) = render()
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "mon"
    assert set(configmap["data"]) == {p.name for p in DASHBOARDS}
    for path in DASHBOARDS:
        assert json.loads(configmap["data"][path.name]) == json.loads(path.read_text())
    assert render("--set", "dashboards.enabled=false") == []
