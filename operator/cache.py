"""The managed model cache: a PVC and a download Job per model and revision, shared by the replicas.

Like NIMCache / KServe's LocalModelCache: `model.cache` on a `uri` source makes the operator create
a PersistentVolumeClaim and a Job running `pagoda download` (in the server image: nothing installed at
start-up) that fills it; the server pods mount the claim read-only once the Job has completed. Names
carry a digest of repo@revision, so a new revision gets a new claim and Job. Pure builders and the
state read from the Job; reconcile.py applies them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pagoda.operator import sources
from pagoda.operator.gpus import GPU_TOLERATION
from pagoda.operator.spec import OperatorConfig, ServiceSpec

CacheState = Literal["Caching", "Cached", "Failed"]
MOUNT = "/models"
BACKOFF_LIMIT = 3  # network hiccups retry; a wrong token or repo fails after 4 pods


@dataclasses.dataclass(frozen=True)
class CacheStatus:
    state: CacheState
    message: str
    claim_name: str
    job_name: str

    def to_dict(self) -> dict[str, Any]:
        """The shape of `status.cache` in the CRD."""
        return {
            "state": self.state,
            "message": self.message,
            "claimName": self.claim_name,
            "job": self.job_name,
        }


def cache_name(spec: ServiceSpec) -> str:
    """`<service>-model-<8 hex of repo@revision or the URI>`: one claim and one Job per model version."""
    digest = hashlib.sha256(sources.label(spec.source.location).encode()).hexdigest()[:8]
    return f"{spec.name[:47]}-model-{digest}"


def selector(spec: ServiceSpec) -> str:
    """Every cache object of this service, of any revision."""
    return f"app.kubernetes.io/name=pagoda-model-cache,app.kubernetes.io/instance={spec.name}"


def stale(spec: ServiceSpec, objects: Iterable[Mapping[str, Any]]) -> list[str]:
    """Names of cache objects of other revisions (to delete once this revision is cached)."""
    return sorted({o["metadata"]["name"] for o in objects} - {cache_name(spec)})


def last_words(pods: Iterable[Mapping[str, Any]]) -> str | None:
    """The download pod's own error (its termination message: the downloader's one line)."""
    for pod in sorted(pods, key=lambda p: p.get("metadata", {}).get("creationTimestamp", ""), reverse=True):
        for status in (pod.get("status") or {}).get("containerStatuses") or ():
            message = ((status.get("state") or {}).get("terminated") or {}).get("message")
            if message:
                return " ".join(message.split())[-400:]
    return None


def _labels(spec: ServiceSpec) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pagoda-model-cache",
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/part-of": "pagoda",
        "app.kubernetes.io/managed-by": "pagoda-operator",
    }


def pvc(spec: ServiceSpec) -> dict[str, Any]:
    cache = spec.cache
    assert cache is not None
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": cache_name(spec), "namespace": spec.namespace, "labels": _labels(spec)},
        "spec": {"accessModes": [cache.access_mode], "resources": {"requests": {"storage": cache.size}}},
    }
    if cache.storage_class_name is not None:
        body["spec"]["storageClassName"] = cache.storage_class_name
    return body


def job(spec: ServiceSpec, config: OperatorConfig, target: str, env: Mapping[str, Any]) -> dict[str, Any]:
    """The download Job: `pagoda download` into the claim's folder `target`; `env`: the container's env
    and envFrom (manifests.download_env: HF_ENDPOINT and proxies from spec.env, the source's secrets)."""
    cache = spec.cache
    assert cache is not None
    container = {
        "name": "download",
        "image": spec.image or config.server_image,
        "command": sources.download_command(spec.source.location, target),
        **env,
        "resources": dict(cache.resources or {"requests": {"cpu": "1", "memory": "1Gi"}}),
        "volumeMounts": [{"name": "model", "mountPath": MOUNT}, {"name": "tmp", "mountPath": "/tmp"}],
        "terminationMessagePolicy": "FallbackToLogsOnError",  # the downloader's one-line error
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [
            {"name": "model", "persistentVolumeClaim": {"claimName": cache_name(spec)}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        ],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    # Where the service's pods may run, the download may too, unless model.cache says where: the node
    # selection and tolerations (a cluster whose only nodes are tainted GPU nodes, a pool the storage
    # reaches), and the GPU taint.
    node_selector = spec.node_selector if cache.node_selector is None else cache.node_selector
    if node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    tolerations = spec.tolerations if cache.tolerations is None else cache.tolerations
    pod_spec["tolerations"] = [*tolerations, GPU_TOLERATION]
    if spec.affinity:
        pod_spec["affinity"] = dict(spec.affinity)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": cache_name(spec), "namespace": spec.namespace, "labels": _labels(spec)},
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            "template": {"metadata": {"labels": _labels(spec)}, "spec": pod_spec},
        },
    }


def pod_selector(job_name: str) -> str:
    """The label selector of a Job's pods (set by the Job controller)."""
    return f"batch.kubernetes.io/job-name={job_name}"


def state(spec: ServiceSpec, job_obj: Mapping[str, Any] | None, detail: str | None = None) -> CacheStatus:
    """Caching until the Job completes, Cached after, Failed with the Job's message (and detail: the
    download pod's last words)."""
    what = sources.label(spec.source.location)
    name = cache_name(spec)
    for cond in ((job_obj or {}).get("status") or {}).get("conditions") or ():
        if cond.get("status") != "True":
            continue
        if cond.get("type") == "Complete":
            return CacheStatus("Cached", f"{what} is in PersistentVolumeClaim {name}", name, name)
        if cond.get("type") == "Failed":
            why = cond.get("message") or cond.get("reason") or "failed"
            why += f"; the download said: {detail}" if detail else ""
            return CacheStatus("Failed", f"download Job {name} of {what} failed: {why}", name, name)
    return CacheStatus("Caching", f"downloading {what} into PersistentVolumeClaim {name}", name, name)
