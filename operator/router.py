"""The router in front of an InferenceService's server pods (`spec.router`): vllm-router, run from the
server image, finds the Ready server pods by their labels (its own ServiceAccount may list and watch
pods in the namespace, nothing else) and sends each request to one by prefix affinity and load
(docs/routing.md says why this router). The InferenceService's Service then selects the router's
pods; `<name>-servers` keeps the server pods reachable (gRPC, which the router does not carry).

Pure builders; manifests.py adds them to the children.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SUFFIX = "-router"
PORT = 8000  # the same port as the servers': clients see no difference
METRICS_PORT = 29000  # vllm-router's Prometheus exporter (vllm_router_*)


def name(service_name: str) -> str:
    return f"{service_name}{SUFFIX}"


def selector_labels(service_name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "pagoda-router", "app.kubernetes.io/instance": service_name}


def labels(service_name: str) -> dict[str, str]:
    return selector_labels(service_name) | {
        "app.kubernetes.io/component": "router",
        "app.kubernetes.io/part-of": "pagoda",
        "app.kubernetes.io/managed-by": "pagoda-operator",
    }


def args(
    namespace: str, server_selector: Mapping[str, str], server_port: int, policy: str, api_key: bool
) -> list[str]:
    """vllm-router's command line: Kubernetes discovery of the server pods, readiness from the servers'
    own probe (a draining or loading server answers 503 and gets nothing), metrics on METRICS_PORT."""
    selector = [f"{k}={v}" for k, v in server_selector.items()]
    out = [
        "--host", "0.0.0.0", "--port", str(PORT),
        "--service-discovery", "--selector", *selector,
        "--service-discovery-namespace", namespace, "--service-discovery-port", str(server_port),
        "--policy", policy,
        "--health-check-endpoint", "/v1/health/ready", "--health-check-interval-secs", "5",
        "--prometheus-host", "0.0.0.0", "--prometheus-port", str(METRICS_PORT),
    ]  # fmt: skip
    if api_key:  # the servers refuse /v1/* without it, the router's own render calls included
        out += ["--api-key", "$(PAGODA_API_KEY)"]
    return out


def children(
    service_name: str,
    namespace: str,
    *,
    image: str,
    image_pull_policy: str | None,
    server_selector: Mapping[str, str],
    server_port: int,
    policy: str,
    replicas: int,
    api_key_env: list[dict[str, Any]],
    pod_security: Mapping[str, Any],
    container_security: Mapping[str, Any],
    placement: Mapping[str, Any],
) -> list[dict[str, Any]]:
    """ServiceAccount, Role, RoleBinding, PDB and Deployment of the router, in apply order. `placement`:
    the pod spec's nodeSelector, tolerations, imagePullSecrets (the service's, where its image is)."""
    router = name(service_name)
    meta = {"name": router, "namespace": namespace, "labels": labels(service_name)}
    rbac = "rbac.authorization.k8s.io/v1"
    container: dict[str, Any] = {
        "name": "router",
        "image": image,
        "command": ["vllm-router"],
        "args": args(namespace, server_selector, server_port, policy, bool(api_key_env)),
        "env": api_key_env,
        "ports": [
            {"name": "http", "containerPort": PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        # vllm-router 0.1.17: /readiness is 200 while at least one server is healthy (so the Service
        # moves to a router only once it can route, and leaves one that cannot); /liveness is 200
        # while it answers. Not /health: that is 503 while any one server is unhealthy (one draining
        # or loading), which would take the routers out with it.
        "readinessProbe": {"httpGet": {"path": "/readiness", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {
            "httpGet": {"path": "/liveness", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": dict(container_security),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if image_pull_policy:
        container["imagePullPolicy"] = image_pull_policy
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(service_name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": labels(service_name)},
                "spec": {
                    "serviceAccountName": router,
                    "automountServiceAccountToken": True,  # its pod discovery reads the API
                    "securityContext": dict(pod_security),
                    "containers": [container],
                    **placement,
                },
            },
        },
    }
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": rbac,
            "kind": "Role",
            "metadata": meta,
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        },
        {
            "apiVersion": rbac,
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": router},
            "subjects": [{"kind": "ServiceAccount", "name": router, "namespace": namespace}],
        },
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": meta,
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(service_name)}},
        },
        deployment,
    ]
