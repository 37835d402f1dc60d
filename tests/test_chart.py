"""The Helm chart: the CRD is the one in crds/, values are documented and typed, the operator's
settings and the RBAC match what the code uses. `helm` runs when it is there (the e2e cluster's
binaries, PAGODA_K8S_BIN, or PATH); the e2e suite installs the chart into a real API server."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagoda.operator import cmd_operator, kube
from pagoda.operator.spec import OperatorConfig

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "pagoda"
CRD = "serving.pagoda.dev_inferenceservices.yaml"


def find_helm() -> str | None:
    candidates = [
        os.environ.get("PAGODA_K8S_BIN", ""),
        *glob.glob(os.path.expanduser("~/.cache/pagoda/k8s/*/bin")),
    ]
    for directory in candidates:
        if directory and os.access(os.path.join(directory, "helm"), os.X_OK):
            return os.path.join(directory, "helm")
    return shutil.which("helm")


HELM = find_helm()
needs_helm = pytest.mark.skipif(HELM is None, reason="no helm binary (run e2e/tools/build.sh)")


def render(*args: str) -> list[dict]:
    assert HELM is not None
    out = subprocess.run(
        [HELM, "template", "pagoda", str(CHART), "--namespace", "pagoda-system", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def test_crd_in_the_chart_is_the_one_source() -> None:
    assert (CHART / "crds" / CRD).read_bytes() == (ROOT / "crds" / CRD).read_bytes()


def test_every_value_is_documented() -> None:
    """Each key has a `# --` comment above it, or sits under a key that has one."""
    undocumented = []
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    comment: list[str] = []  # the comment block right above the current line
    for line in (CHART / "values.yaml").read_text().splitlines():
        match = re.match(r"^(\s*)([A-Za-z][\w.-]*):", line)
        if match:
            indent = len(match.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            documented = any(c.startswith("# --") for c in comment) or any(d for _, d in stack)
            value = line.split(":", 1)[1].strip()
            is_leaf = value not in ("",)
            if is_leaf and not documented:
                undocumented.append(line.strip())
            stack.append((indent, documented))
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped)
        elif stripped:
            comment = []
    assert undocumented == []


def test_values_schema_is_strict_and_matches_values() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert schema["additionalProperties"] is False
    assert set(values) == set(schema["properties"])


def test_chart_defaults_match_the_operator() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    server = values["inferenceDefaults"]["server"]["image"]
    assert f"{server['repository']}:{server['tag'] or chart['appVersion']}" == OperatorConfig().server_image
    defaults = values["inferenceDefaults"]
    assert defaults["drainSeconds"] == OperatorConfig().drain_seconds
    assert defaults["startupTimeoutSeconds"] == OperatorConfig().startup_timeout_seconds


@needs_helm
def test_helm_lint_is_clean() -> None:
    assert HELM is not None
    out = subprocess.run([HELM, "lint", "--strict", str(CHART)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout


@needs_helm
def test_operator_env_are_operator_flags() -> None:
    (deployment,) = [d for d in render() if d["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["operator"]
    import argparse

    flags = set()
    parser = argparse.ArgumentParser()
    cmd_operator.add_arguments(parser)
    for action in parser._actions:
        flags |= {f"PAGODA_OPERATOR_{o[2:].upper().replace('-', '_')}" for o in action.option_strings}
    env = {e["name"] for e in container["env"]}
    assert env <= flags
    assert {"PAGODA_OPERATOR_SERVER_IMAGE", "PAGODA_OPERATOR_DRAIN_SECONDS"} <= env


@needs_helm
def test_rbac_covers_every_kind_the_operator_writes() -> None:
    (role,) = [d for d in render() if d["kind"] == "ClusterRole"]
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    for (api_version, kind), plural in kube.PLURALS.items():
        group = api_version.rpartition("/")[0]
        need = {"get", "list", "watch"}
        if kind not in kube.READ_ONLY:
            need |= {"patch", "delete"}  # server-side apply creates with patch
        if kind in ("Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Ingress"):
            need.add("update")  # a child drifted where apply cannot undo it is replaced
        assert need <= granted.get((group, plural), set()), (kind, granted.get((group, plural)))
    assert "patch" in granted[("serving.pagoda.dev", "inferenceservices/status")]
    assert "create" in granted[("", "events")]
    # Least privilege: no wildcards; no Secret at all (the pods reference them; a missing one shows in
    # their status); pods read only.
    assert not any("*" in r["verbs"] or "*" in r["resources"] for r in role["rules"])
    assert not any(resource.startswith("secrets") for _, resource in granted)
    assert granted[("", "pods")] == {"get", "list", "watch"}


@needs_helm
def test_values_reach_the_operator() -> None:
    docs = render(
        "--set", "operator.watchNamespaces={a,b}", "--set", "inferenceDefaults.kernelCachePvc=cache"
    )
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PAGODA_OPERATOR_NAMESPACE"] == "a,b"
    assert env["PAGODA_OPERATOR_KERNEL_CACHE_PVC"] == "cache"
    labels = deployment["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "pagoda" and labels["app.kubernetes.io/instance"] == "pagoda"
    assert deployment["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "pagoda",
        "app.kubernetes.io/instance": "pagoda",
    }


@needs_helm
def test_adapter_rules_serve_the_hpa_metric_names() -> None:
    from pagoda.operator import manifests

    (config_map,) = [d for d in render() if d["metadata"]["name"].endswith("-adapter-rules")]
    rules = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    assert {r["name"]["as"] for r in rules} == {
        manifests.QUEUE_METRIC,
        manifests.KV_CACHE_METRIC,
        manifests.DCGM_METRIC,
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    }
    for rule in rules:  # every rule finds its pods by the labels the PodMonitor and recording rule give
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
        series = re.match(r"[^{]+", rule["seriesQuery"]).group(0)  # type: ignore[union-attr]
        assert re.fullmatch(rule["name"]["matches"], series), rule
    dcgm = next(r for r in rules if r["name"]["as"] == manifests.DCGM_METRIC)
    (record,) = [
        r
        for g in monitoring_objects(True)["PrometheusRule/pagoda-dcgm"]["spec"]["groups"]
        for r in g["rules"]
    ]
    assert dcgm["seriesQuery"].startswith(record["record"] + "{")


def test_vllm_names_in_the_adapter_rules_are_exported() -> None:
    """The adapter's vLLM-named rules ask for series the server really exports (docs/metrics.md)."""
    documented = set(re.findall(r"^\| `([^`]+)` \|", (ROOT / "docs" / "metrics.md").read_text(), re.M))
    text = (CHART / "templates" / "adapter-rules.yaml").read_text()
    assert set(re.findall(r"seriesQuery: '(vllm:[a-z_]+)", text)) <= documented


def monitoring_objects(enabled: bool | str, *args: str) -> dict[str, dict]:
    """The prometheus-operator objects the chart renders, as {"Kind/name": object}, with every
    `monitoring.*.enabled` set to `enabled`."""
    flags = [
        f"monitoring.{kind}.enabled={str(enabled).lower()}"
        for kind in ("podMonitor", "serviceMonitor", "prometheusRule")
    ]
    docs = render(*[a for f in flags for a in ("--set", f)], *args)
    return {
        f"{d['kind']}/{d['metadata']['name']}": d
        for d in docs
        if d["apiVersion"].startswith("monitoring.coreos.com/")
    }


@needs_helm
def test_monitors_render_when_the_crds_exist_or_when_asked() -> None:
    assert monitoring_objects("auto") == {}  # no prometheus-operator in `helm template`'s default cluster
    apis = [a for k in ("PodMonitor", "ServiceMonitor", "PrometheusRule")
            for a in ("--api-versions", f"monitoring.coreos.com/v1/{k}")]  # fmt: skip
    kinds = {d["kind"] for d in monitoring_objects("auto", *apis).values()}
    assert kinds == {"PodMonitor", "ServiceMonitor", "PrometheusRule"}
    assert monitoring_objects(False, *apis) == {}
    # Defaults with the CRDs: the PodMonitor and the rule, not the ServiceMonitor (double series).
    defaults = render(*apis)
    names = {
        f"{d['kind']}/{d['metadata']['name']}" for d in defaults if d["apiVersion"].startswith("monitoring")
    }
    assert names == {
        "PodMonitor/pagoda-servers",
        "PodMonitor/pagoda-routers",
        "PodMonitor/pagoda-operator",
        "PrometheusRule/pagoda-dcgm",
    }
    got = monitoring_objects(True, "--set", "operator.watchNamespaces={a,b}")
    pod_monitor, service_monitor = got["PodMonitor/pagoda-servers"], got["ServiceMonitor/pagoda-servers"]
    from pagoda.operator import manifests

    server_labels = manifests.labels(_spec())
    for monitor in (pod_monitor, service_monitor):
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}
        assert monitor["spec"]["selector"]["matchLabels"].items() <= server_labels.items()
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    assert service_monitor["spec"]["endpoints"][0]["port"] == "metrics"
    service_ports = {p["name"] for p in manifests.service(_spec())["spec"]["ports"]}
    assert "metrics" in service_ports
    # The routers' PodMonitor selects the router pods the operator renders, on their metrics port; the
    # ServiceMonitor reaches them through the Service's router-metrics port.
    from pagoda.operator import router

    routed = dataclasses.replace(_spec(), router=dataclasses.replace(_spec().router, enabled=True))
    (router_deployment,) = [
        c for c in router.children("x", "ns", **_router_kwargs()) if c["kind"] == "Deployment"
    ]
    router_pod = router_deployment["spec"]["template"]
    router_monitor = got["PodMonitor/pagoda-routers"]
    assert router_monitor["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}
    assert (
        router_monitor["spec"]["selector"]["matchLabels"].items() <= router_pod["metadata"]["labels"].items()
    )
    assert not router_monitor["spec"]["selector"]["matchLabels"].items() <= server_labels.items()
    router_ports = {p["name"] for p in router_pod["spec"]["containers"][0]["ports"]}
    assert router_monitor["spec"]["podMetricsEndpoints"][0]["port"] in router_ports
    routed_ports = {p["name"] for p in manifests.service(routed)["spec"]["ports"]}
    assert [e["port"] for e in service_monitor["spec"]["endpoints"]] == ["metrics", "router-metrics"]
    assert "router-metrics" in routed_ports and "metrics" not in routed_ports  # servers: <name>-servers
    # The operator's own PodMonitor: its pod's selector labels, its `metrics` port; none without the port.
    operator_monitor = got["PodMonitor/pagoda-operator"]
    (deployment,) = [d for d in render() if d["kind"] == "Deployment"]
    assert (
        operator_monitor["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    )
    ports = {p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert operator_monitor["spec"]["podMetricsEndpoints"][0]["port"] in ports
    assert "PodMonitor/pagoda-operator" not in monitoring_objects(True, "--set", "operator.metricsPort=0")


@needs_helm
def test_dcgm_recording_rule_maps_the_exported_labels() -> None:
    (rule,) = monitoring_objects(True)["PrometheusRule/pagoda-dcgm"]["spec"]["groups"][0]["rules"]
    assert '"pod", "$1", "exported_pod"' in rule["expr"] and '"exported_namespace"' in rule["expr"]
    assert rule["expr"].startswith("avg by (namespace, pod)")
    flag = ("--set", "monitoring.prometheusRule.dcgmExportedLabels=false")
    (rule,) = monitoring_objects(True, *flag)["PrometheusRule/pagoda-dcgm"]["spec"]["groups"][0]["rules"]
    assert "exported" not in rule["expr"]


def _router_kwargs() -> dict[str, Any]:
    return {
        "image": "pagoda-server:dev",
        "image_pull_policy": None,
        "server_selector": {"app.kubernetes.io/name": "pagoda-server"},
        "server_port": 8000,
        "policy": "cache_aware",
        "replicas": 2,
        "api_key_env": [],
        "pod_security": {},
        "container_security": {},
        "placement": {},
    }


def _spec() -> Any:
    """A ServiceSpec named x in ns, for the label and Service builders."""
    from pagoda.operator.spec import parse_spec

    model = {"name": "llama-3.1-8b", "source": {"imagePath": "/m"}}
    return parse_spec({"metadata": {"name": "x", "namespace": "ns"}, "spec": {"model": model}})


@needs_helm
def test_operator_stays_off_gpu_nodes_unless_told() -> None:
    (deployment,) = [d for d in render() if d["kind"] == "Deployment"]
    terms = deployment["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms == [
        {"matchExpressions": [{"key": "nvidia.com/gpu.present", "operator": "NotIn", "values": ["true"]}]}
    ]
    (deployment,) = [d for d in render("--set", "operator.affinity=null") if d["kind"] == "Deployment"]
    assert "affinity" not in deployment["spec"]["template"]["spec"]


@needs_helm
def test_operator_metrics_port_is_served_named_and_annotated() -> None:
    (deployment,) = [d for d in render() if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["PAGODA_OPERATOR_METRICS_PORT"] == "8081"
    assert cmd_operator._port(env["PAGODA_OPERATOR_METRICS_PORT"]) == 8081  # what the flag parses
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": 8080, "metrics": 8081}  # kopf's liveness keeps 8080
    assert pod["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8081",
        "prometheus.io/path": "/metrics",
    }
    # A PodMonitor selects the pod by its labels and scrapes the port by name.
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"

    docs = render("--set", "operator.metricsPort=9090", "--set", "operator.podAnnotations.team=infra")
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9090"
    assert pod["metadata"]["annotations"]["team"] == "infra"
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in pod["spec"]["containers"][0][
        "ports"
    ]

    (deployment,) = [d for d in render("--set", "operator.metricsPort=0") if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]
    assert "annotations" not in pod["metadata"]
    assert [p["name"] for p in pod["spec"]["containers"][0]["ports"]] == ["health"]
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["PAGODA_OPERATOR_METRICS_PORT"] == "0"  # off: the flag's 0

    assert HELM is not None
    for bad in ("8080", "70000", "-1"):  # liveness's port, not a port
        out = subprocess.run(
            [HELM, "template", "pagoda", str(CHART), "--set", f"operator.metricsPort={bad}"],
            capture_output=True,
            text=True,
        )
        assert out.returncode != 0 and "metricsPort" in out.stderr, (bad, out.stderr)


@needs_helm
def test_operator_pod_is_locked_down() -> None:
    """The operator's pod: not root (the image's own user), no privilege escalation, no capabilities, the
    runtime's seccomp profile, a read-only root with a writable /tmp; one replica, replaced rather than
    rolled (kopf runs standalone: two would reconcile the same objects); bound to the ClusterRole
    through its own ServiceAccount."""
    docs = render()
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    dockerfile = (ROOT / "docker" / "operator.Dockerfile").read_text()
    uid, gid = re.findall(r"^USER (\d+):(\d+)$", dockerfile, re.M)[-1]
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": int(uid),
        "runAsGroup": int(gid),
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    (container,) = pod["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/tmp"]] == {"name": mounts["/tmp"], "emptyDir": {}}
    assert "privileged" not in container["securityContext"] and "hostNetwork" not in pod
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}

    (account,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    (binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "pagoda-system"}
    ]


@needs_helm
def test_the_uninstall_hook_runs_pagoda_uninstall_as_the_values_say() -> None:
    def hook(*args: str) -> dict | None:
        jobs = [d for d in render(*args) if d["kind"] == "Job"]
        assert len(jobs) <= 1
        return jobs[0] if jobs else None

    job = hook("--set", "operator.watchNamespaces={a,b}")
    assert job is not None
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "pagoda"  # the operator's account: delete on inferenceservices
    (container,) = pod["containers"]
    assert container["args"] == ["uninstall", "--timeout=600", "--namespace=a", "--namespace=b"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    refusing = hook(
        "--set", "uninstall.deleteInferenceServices=false", "--set", "uninstall.keepModelCache=true"
    )
    assert refusing is not None
    assert refusing["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "uninstall",
        "--timeout=600",
        "--refuse",
        "--keep-model-cache",
    ]
    assert hook("--set", "uninstall.hook=false") is None
    role = next(d for d in render() if d["kind"] == "ClusterRole")
    isvc = next(r for r in role["rules"] if r["resources"] == ["inferenceservices"])
    assert "delete" in isvc["verbs"]
