"""The managed model cache: a PVC and a download Job per model and revision, shared by the replicas.

Like NIMCache / KServe's LocalModelCache: `model.cache` on a `uri` source makes the operator create
a PersistentVolumeClaim and a Job running `pagoda download` (in the server image: nothing installed at
start-up) that fills it; the server pods mount the claim read-only once the Job has completed. Names
carry a digest of repo@revision, so a new revision gets a new claim and Job. LoRA adapters with a `uri`
source are fetched by the same Job into the same claim (one init container each, before the model):
the Job's name also carries their digest, so a changed adapter list gets a new Job on the same claim,
which finds the model already there (`pagoda download` skips a finished folder); one Job writes the
claim at a time (superseded_jobs, writing_pod). Pure builders and the
state read from the Job; reconcile.py applies them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from pagoda.operator import sources
from pagoda.operator.gpus import GPU_TOLERATION
from pagoda.operator.spec import Adapter, OperatorConfig, ServiceSpec

CacheState = Literal["Caching", "Cached", "Failed"]
MOUNT = "/models"
BACKOFF_LIMIT = 3  # network hiccups retry; a wrong token or repo fails after 4 pods
DONE = ("Succeeded", "Failed")  # pod phases


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


def uri_adapters(spec: ServiceSpec) -> tuple[Adapter, ...]:
    """The adapters the cache Job downloads."""
    return tuple(a for a in spec.adapters if a.source.kind == "uri")


def _name(spec: ServiceSpec, with_adapters: bool) -> str:
    key = sources.label(spec.source.location)
    if with_adapters:  # nothing added without uri adapters: the names of caches made before them stay
        key += "".join(f" {a.name}={sources.label(a.source.location)}" for a in uri_adapters(spec))
    return f"{spec.name[:47]}-model-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def cache_name(spec: ServiceSpec) -> str:
    """The claim: `<service>-model-<8 hex of repo@revision or the URI>`, one per model version. A
    ReadWriteOncePod claim, which a new download Job cannot mount while the server pods hold it, is one
    per model version and adapter list."""
    cache = spec.cache
    return _name(spec, with_adapters=cache is not None and cache.access_mode == "ReadWriteOncePod")


def job_name(spec: ServiceSpec) -> str:
    """The download Job: one per model version and list of uri adapters (the claim's name without any)."""
    return _name(spec, with_adapters=True)


def selector(spec: ServiceSpec) -> str:
    """Every cache object of this service, of any revision."""
    return f"app.kubernetes.io/name=pagoda-model-cache,app.kubernetes.io/instance={spec.name}"


def stale(spec: ServiceSpec, kind: str, objects: Iterable[Mapping[str, Any]]) -> list[str]:
    """Names of cache Jobs or claims (`kind`) of other revisions or adapter lists (to delete once this
    one is cached)."""
    keep = job_name(spec) if kind == "Job" else cache_name(spec)
    return sorted({o["metadata"]["name"] for o in objects} - {keep})


def _finished(job_obj: Mapping[str, Any]) -> bool:
    conditions = (job_obj.get("status") or {}).get("conditions") or ()
    return any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in conditions)


def _writes_claim(spec: ServiceSpec, pod_spec: Mapping[str, Any]) -> bool:
    volumes = pod_spec.get("volumes") or ()
    return any((v.get("persistentVolumeClaim") or {}).get("claimName") == cache_name(spec) for v in volumes)


def superseded_jobs(spec: ServiceSpec, jobs: Iterable[Mapping[str, Any]]) -> list[str]:
    """Unfinished Jobs of other adapter lists writing this claim: no longer wanted, and in the way of
    this list's Job (two Jobs fetching the model into one folder would mix their partial files)."""
    return sorted(
        j["metadata"]["name"]
        for j in jobs
        if j["metadata"]["name"] != job_name(spec)
        and _writes_claim(spec, j["spec"]["template"]["spec"])
        and not _finished(j)
    )


def writing_pod(spec: ServiceSpec, pods: Iterable[Mapping[str, Any]]) -> str | None:
    """`pod P of download Job J`: a pod of another cache Job that may still write this claim (a deleted
    Job's pods stop after it is gone), or None."""
    for pod in pods:
        job = (pod["metadata"].get("labels") or {}).get("batch.kubernetes.io/job-name")
        phase = (pod.get("status") or {}).get("phase")
        if job != job_name(spec) and _writes_claim(spec, pod.get("spec") or {}) and phase not in DONE:
            return f"pod {pod['metadata']['name']} of download Job {job}"
    return None


def last_words(pods: Iterable[Mapping[str, Any]]) -> str | None:
    """The download pod's own error (its termination message: the downloader's one line), from the
    adapters' init containers or the model's container."""
    for pod in sorted(pods, key=lambda p: p.get("metadata", {}).get("creationTimestamp", ""), reverse=True):
        status = pod.get("status") or {}
        for container in [
            *(status.get("initContainerStatuses") or ()),
            *(status.get("containerStatuses") or ()),
        ]:
            message = ((container.get("state") or {}).get("terminated") or {}).get("message")
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


def job(
    spec: ServiceSpec,
    config: OperatorConfig,
    target: str,
    env: Mapping[str, Any],
    adapters: Sequence[tuple[Adapter, str, Mapping[str, Any]]] = (),
) -> dict[str, Any]:
    """The download Job: `pagoda download` into the claim's folder `target`; `env`: the container's env
    and envFrom (model_mounts.download_env: HF_ENDPOINT and proxies from spec.env, the source's secrets).
    `adapters`: (adapter, folder, env) of each uri adapter, fetched first, each by an init container
    with its own source's secrets (small, and a wrong token fails before the model's hours)."""
    cache = spec.cache
    assert cache is not None

    def download(name: str, uri: str, folder: str, env: Mapping[str, Any]) -> dict[str, Any]:
        container = {
            "name": name,
            "image": spec.image or config.server_image,
            "command": sources.download_command(uri, folder),
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
        return container

    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [download("download", spec.source.location, target, env)],
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
    if adapters:
        pod_spec["initContainers"] = [
            download(f"download-adapter-{i}", adapter.source.location, folder, adapter_env)
            for i, (adapter, folder, adapter_env) in enumerate(adapters)
        ]
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
        "metadata": {"name": job_name(spec), "namespace": spec.namespace, "labels": _labels(spec)},
        "spec": {
            "backoffLimit": BACKOFF_LIMIT,
            "template": {"metadata": {"labels": _labels(spec)}, "spec": pod_spec},
        },
    }


def pod_selector(job_name: str) -> str:
    """The label selector of a Job's pods (set by the Job controller)."""
    return f"batch.kubernetes.io/job-name={job_name}"


def state(
    spec: ServiceSpec,
    job_obj: Mapping[str, Any] | None,
    detail: str | None = None,
    waiting_for: str | None = None,
) -> CacheStatus:
    """Caching until the Job completes, Cached after, Failed with the Job's message (and detail: the
    download pod's last words); `waiting_for`: what this Job waits for before it is created
    (writing_pod)."""
    what = sources.label(spec.source.location)
    if num_adapters := len(uri_adapters(spec)):
        what += f" and {num_adapters} adapter{'s' if num_adapters > 1 else ''}"
    name, job = cache_name(spec), job_name(spec)
    for cond in ((job_obj or {}).get("status") or {}).get("conditions") or ():
        if cond.get("status") != "True":
            continue
        if cond.get("type") == "Complete":
            verb = "are" if num_adapters else "is"
            return CacheStatus("Cached", f"{what} {verb} in PersistentVolumeClaim {name}", name, job)
        if cond.get("type") == "Failed":
            why = cond.get("message") or cond.get("reason") or "failed"
            why += f"; the download said: {detail}" if detail else ""
            return CacheStatus("Failed", f"download Job {job} of {what} failed: {why}", name, job)
    if waiting_for is not None:
        message = f"waiting for {waiting_for} to stop writing PersistentVolumeClaim {name}"
        return CacheStatus("Caching", f"{message} before fetching {what}", name, job)
    return CacheStatus("Caching", f"downloading {what} into PersistentVolumeClaim {name}", name, job)
