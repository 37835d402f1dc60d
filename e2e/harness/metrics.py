"""The e2e metrics pipeline: a real Prometheus and a real prometheus-adapter, as host processes of the
test cluster, fed with the chart's own monitoring objects.

- Prometheus (3.5 LTS, built by tools/build-metrics.sh with Kubernetes discovery) discovers the server
  pods through Kubernetes service discovery against the test kube-apiserver, as a ServiceAccount with
  kube-prometheus-stack's read rights, and scrapes them with the scrape config prometheus-operator
  generates from the chart's PodMonitor (`pod_monitor_scrape_config`). It loads the chart's
  PrometheusRule groups as its rule file. Static targets (the DCGM test double, a host operator) are
  added at run time through file_sd; an operator pod of an installed release by its own PodMonitor
  (`scrape_operator_of`), as prometheus-operator would pick it up: the config rewritten and reloaded.
- prometheus-adapter v0.12.0 (built by the same script) serves custom.metrics.k8s.io v1beta1/v1beta2 from the
  chart's adapter rules, registered by APIServices whose Service is an ExternalName to localhost (as in
  test_aggregation.py); kube-apiserver reaches it with its front-proxy client certificate, and the real
  HPA controller reads it.

Every process names the cluster's work directory (its config lives there), so the cluster's teardown
stops them.
"""

from __future__ import annotations

import json
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE.parent / "tools" / "build-metrics.sh"
CHART = HERE.parents[1] / "charts" / "pagoda"
NAMESPACE = "pagoda-metrics"
CUSTOM_METRICS = "custom.metrics.k8s.io"
SCRAPE_INTERVAL = "3s"  # the chart's 15 s would add up to 15 s to each HPA reaction in the tests
ADAPTER_RELIST = "5s"  # metric names appear to the HPA this long after their first series


def ensure_binaries() -> Path:
    """Runs build-metrics.sh (a no-op once cached) and returns its bin directory (prometheus, adapter)."""
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} failed (exit {proc.returncode}); its log is above")
    return Path(proc.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class ChartMonitoring:
    """What the chart gives a Prometheus stack: adapter rules (the adapter's config file, as text), the
    PrometheusRule's rule groups, the servers' PodMonitor, the routers' and the operator's."""

    adapter_rules: str
    rule_groups: list[dict[str, Any]]
    pod_monitor: dict[str, Any]
    router_pod_monitor: dict[str, Any]
    operator_pod_monitor: dict[str, Any]


def render_chart(
    helm: Path, interval: str = SCRAPE_INTERVAL, release: str = "pagoda", namespace: str = NAMESPACE
) -> ChartMonitoring:
    """The chart's monitoring objects, rendered by helm as a kube-prometheus-stack cluster would get them
    for `release` installed in `namespace` (the operator's PodMonitor selects by both)."""
    out = subprocess.run(
        [str(helm), "template", release, str(CHART), "--namespace", namespace,
         "--set", "monitoring.podMonitor.enabled=true", "--set", "monitoring.prometheusRule.enabled=true",
         "--set", f"monitoring.podMonitor.interval={interval}"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip

    def one(kind: str, suffix: str) -> dict[str, Any]:
        [doc] = [
            d
            for d in yaml.safe_load_all(out)
            if d and d["kind"] == kind and d["metadata"]["name"].endswith(suffix)
        ]
        return doc

    return ChartMonitoring(
        one("ConfigMap", "-adapter-rules")["data"]["config.yaml"],
        one("PrometheusRule", "-dcgm")["spec"]["groups"],
        one("PodMonitor", "-servers"),
        one("PodMonitor", "-routers"),
        one("PodMonitor", "-operator"),
    )


def _label_name(label: str) -> str:
    """A Kubernetes label as Prometheus's service discovery names it (__meta_..._label_<this>)."""
    return "".join(c if c.isalnum() else "_" for c in label)


def pod_monitor_scrape_config(pod_monitor: dict[str, Any], kubeconfig: Path) -> list[dict[str, Any]]:
    """The scrape configs prometheus-operator generates from a PodMonitor (one per endpoint): pod role
    discovery in the selected namespaces, keep by labels and port name, and `namespace`, `pod`,
    `container`, `endpoint`, `job` target labels."""
    meta, spec = pod_monitor["metadata"], pod_monitor["spec"]
    sd: dict[str, Any] = {"role": "pod", "kubeconfig_file": str(kubeconfig)}
    selector = spec.get("namespaceSelector", {})
    if not selector.get("any"):  # no selector: the PodMonitor's own namespace only
        sd["namespaces"] = {"names": selector.get("matchNames") or [meta["namespace"]]}
    configs = []
    for i, endpoint in enumerate(spec["podMetricsEndpoints"]):
        relabel: list[dict[str, Any]] = [
            {
                "source_labels": ["__meta_kubernetes_pod_phase"],
                "regex": "(Failed|Succeeded)",
                "action": "drop",
            }
        ]
        for label, value in spec["selector"].get("matchLabels", {}).items():
            name = _label_name(label)
            relabel.append({
                "source_labels": [f"__meta_kubernetes_pod_label_{name}",
                                  f"__meta_kubernetes_pod_labelpresent_{name}"],
                "regex": f"({value});true", "action": "keep",
            })  # fmt: skip
        relabel += [
            {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": endpoint["port"],
             "action": "keep"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"},
            {"target_label": "endpoint", "replacement": endpoint["port"]},
        ]  # fmt: skip
        configs.append({
            "job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/{i}",
            "honor_labels": endpoint.get("honorLabels", False),
            "scrape_interval": endpoint.get("interval", SCRAPE_INTERVAL),
            "metrics_path": endpoint.get("path", "/metrics"),
            "kubernetes_sd_configs": [sd],
            "relabel_configs": relabel,
        })  # fmt: skip
    return configs


@dataclass
class MetricsPipeline:
    """A running Prometheus (`url`) and adapter (`adapter_port`); static targets go to `targets_dir`."""

    url: str
    adapter_port: int
    targets_dir: Path
    config: Path  # prometheus.yml
    helm: Path
    kubeconfig: Path  # Prometheus's ServiceAccount

    def scrape_operator_of(self, release: str, namespace: str) -> None:
        """Scrape the operator pod of the chart installed as `release` in `namespace`, by the chart's own
        operator PodMonitor for that release, as prometheus-operator would once the chart creates it."""
        monitor = render_chart(self.helm, release=release, namespace=namespace).operator_pod_monitor
        config = yaml.safe_load(self.config.read_text())
        jobs = {c["job_name"] for c in config["scrape_configs"]}
        config["scrape_configs"] += [
            c for c in pod_monitor_scrape_config(monitor, self.kubeconfig) if c["job_name"] not in jobs
        ]
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))
        request = urllib.request.Request(f"{self.url}/-/reload", method="POST")
        with urllib.request.urlopen(request, timeout=30) as r:
            assert r.status == 200, r.status

    def add_target(self, job: str, address: str, labels: dict[str, str]) -> None:
        """Scrape `address` (host:port) as `job` with these target labels (file_sd; read within seconds)."""
        groups = [{"targets": [address], "labels": {"job": job, **labels}}]
        tmp = self.targets_dir / f"{job}.json.tmp"  # not matched by the *.json of file_sd
        tmp.write_text(json.dumps(groups))
        tmp.rename(self.targets_dir / f"{job}.json")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant PromQL query: the result vector (raises on a bad expression)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)["data"]["result"]

    def series(self, match: str) -> list[dict[str, str]]:
        url = f"{self.url}/api/v1/series?" + urllib.parse.urlencode({"match[]": match})
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)["data"]

    def targets(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as r:
            return json.load(r)["data"]["activeTargets"]


# Read rights of the two ServiceAccounts, as kube-prometheus-stack and the prometheus-adapter chart grant.
_RBAC = """
apiVersion: v1
kind: List
items:
- {apiVersion: v1, kind: ServiceAccount, metadata: {name: prometheus, namespace: NS}}
- {apiVersion: v1, kind: ServiceAccount, metadata: {name: prometheus-adapter, namespace: NS}}
- apiVersion: rbac.authorization.k8s.io/v1
  kind: ClusterRole
  metadata: {name: pagoda-e2e-prometheus}
  rules:
  - {apiGroups: [""], resources: [nodes, services, endpoints, pods], verbs: [get, list, watch]}
  - {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [get, list, watch]}
- apiVersion: rbac.authorization.k8s.io/v1
  kind: ClusterRole
  metadata: {name: pagoda-e2e-prometheus-adapter}
  rules:
  - {apiGroups: [""], resources: [namespaces, pods, services, nodes], verbs: [get, list, watch]}
- apiVersion: rbac.authorization.k8s.io/v1
  kind: ClusterRoleBinding
  metadata: {name: pagoda-e2e-prometheus}
  roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: pagoda-e2e-prometheus}
  subjects: [{kind: ServiceAccount, name: prometheus, namespace: NS}]
- apiVersion: rbac.authorization.k8s.io/v1
  kind: ClusterRoleBinding
  metadata: {name: pagoda-e2e-prometheus-adapter}
  roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: pagoda-e2e-prometheus-adapter}
  subjects: [{kind: ServiceAccount, name: prometheus-adapter, namespace: NS}]
- apiVersion: rbac.authorization.k8s.io/v1
  kind: ClusterRoleBinding
  metadata: {name: pagoda-e2e-prometheus-adapter-auth-delegator}
  roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:auth-delegator"}
  subjects: [{kind: ServiceAccount, name: prometheus-adapter, namespace: NS}]
- apiVersion: rbac.authorization.k8s.io/v1
  kind: RoleBinding
  metadata: {name: pagoda-e2e-prometheus-adapter-auth-reader, namespace: kube-system}
  roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: extension-apiserver-authentication-reader}
  subjects: [{kind: ServiceAccount, name: prometheus-adapter, namespace: NS}]
"""


def _prometheus_config(workdir: Path, chart: ChartMonitoring, kubeconfig: Path) -> Path:
    (workdir / "rules.yaml").write_text(yaml.safe_dump({"groups": chart.rule_groups}))
    config = {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": [str(workdir / "rules.yaml")],
        "scrape_configs": [
            *pod_monitor_scrape_config(chart.pod_monitor, kubeconfig),
            *pod_monitor_scrape_config(chart.router_pod_monitor, kubeconfig),
            {
                "job_name": "static",  # each target's file names its own job
                "file_sd_configs": [
                    {"files": [str(workdir / "targets" / "*.json")], "refresh_interval": "2s"}
                ],
            },
        ],
    }
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def start(
    cluster: Any,
    helm: Path,
    bin_dir: Path,
    spawn: Callable[[str, list[str]], subprocess.Popen],
    wait: Callable[[str, Callable[[], bool], dict[str, subprocess.Popen]], None],
    free_ports: Callable[[int], list[int]],
) -> MetricsPipeline:
    """Starts Prometheus and the adapter for `cluster` and waits until the custom metrics API is
    Available through kube-apiserver."""
    workdir = cluster.workdir / "metrics"
    (workdir / "targets").mkdir(parents=True, exist_ok=True)
    chart = render_chart(helm)
    (workdir / "adapter-rules.yaml").write_text(chart.adapter_rules)
    cluster.kubectl("create", "namespace", NAMESPACE)
    cluster.kubectl("apply", "-f", "-", input=_RBAC.replace("NS", NAMESPACE))
    prom_kc = cluster.serviceaccount_kubeconfig(NAMESPACE, "prometheus", duration="12h")
    adapter_kc = cluster.serviceaccount_kubeconfig(NAMESPACE, "prometheus-adapter", duration="12h")
    prom_port, adapter_port = free_ports(2)
    url = f"http://127.0.0.1:{prom_port}"
    procs = {
        "prometheus": spawn("prometheus", [
            str(bin_dir / "prometheus"), f"--config.file={_prometheus_config(workdir, chart, prom_kc)}",
            f"--storage.tsdb.path={workdir}/tsdb", f"--web.listen-address=127.0.0.1:{prom_port}",
            "--storage.tsdb.retention.time=2h", "--log.level=warn", "--web.enable-lifecycle",
        ]),
    }  # fmt: skip

    def prometheus_ready() -> bool:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
            return r.status == 200

    wait("Prometheus /-/ready", prometheus_ready, procs)
    procs["prometheus-adapter"] = spawn("prometheus-adapter", [
        str(bin_dir / "adapter"), f"--config={workdir}/adapter-rules.yaml", f"--prometheus-url={url}/",
        f"--metrics-relist-interval={ADAPTER_RELIST}", f"--secure-port={adapter_port}",
        "--bind-address=127.0.0.1", f"--cert-dir={workdir}/adapter-certs",
        f"--lister-kubeconfig={adapter_kc}", f"--authentication-kubeconfig={adapter_kc}",
        f"--authorization-kubeconfig={adapter_kc}", "--v=2",
    ])  # fmt: skip
    cluster.kubectl("apply", "-f", "-", input=json.dumps(_adapter_registration(adapter_port)))

    def available() -> bool:
        got = cluster.kubectl("get", "apiservices", "-o", "json", check=False)
        items = json.loads(got.stdout)["items"] if got.returncode == 0 else []
        return all(
            any(c["type"] == "Available" and c["status"] == "True" for c in a["status"].get("conditions", []))
            for a in items
            if a["spec"].get("group") == CUSTOM_METRICS
        )

    wait(f"APIService {CUSTOM_METRICS} Available", available, procs)
    return MetricsPipeline(url, adapter_port, workdir / "targets", workdir / "prometheus.yml", helm, prom_kc)


def _adapter_registration(port: int) -> dict[str, Any]:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "prometheus-adapter", "namespace": NAMESPACE},
        "spec": {"type": "ExternalName", "externalName": "localhost"},  # no kube-proxy for the host
    }
    apiservices = [
        {
            "apiVersion": "apiregistration.k8s.io/v1",
            "kind": "APIService",
            "metadata": {"name": f"{version}.{CUSTOM_METRICS}"},
            "spec": {
                "group": CUSTOM_METRICS,
                "version": version,
                "groupPriorityMinimum": 100,
                "versionPriority": priority,
                "insecureSkipTLSVerify": True,  # the adapter's certificate is self-signed (--cert-dir)
                "service": {"name": "prometheus-adapter", "namespace": NAMESPACE, "port": port},
            },
        }
        for version, priority in (("v1beta1", 100), ("v1beta2", 200))
    ]
    return {"apiVersion": "v1", "kind": "List", "items": [service, *apiservices]}
