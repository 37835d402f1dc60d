"""Where the weights and the LoRA adapters are in a server pod: the paths the server loads (--model,
--lora-modules), the volumes and mounts that put them there, and the `pagoda download` init containers
that fill them from a uri source when no model cache holds them.
"""

from __future__ import annotations

import posixpath
from typing import Any

from pagoda.operator import sources
from pagoda.operator.cache import cache_name
from pagoda.operator.spec import Adapter, ModelSource, OperatorConfig, ServiceSpec

GIB = 1024**3
MODEL_DIR = "/models"
# LoRA adapters not under MODEL_DIR: node paths at host/<name>, other claims at pvc/<claim>, downloads
# (without a model cache) at uri/<name>; with a model cache they are downloaded into it, under
# CACHED_ADAPTERS. Siblings, never nested: a mount inside a read-only mount cannot be created.
ADAPTER_DIR = "/adapters"
DOWNLOADED = f"{ADAPTER_DIR}/uri"
CACHED_ADAPTERS = "adapters"


def container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def adapter_path(spec: ServiceSpec, adapter: Adapter) -> str:
    """Where the server loads an adapter from (its --lora-modules PATH)."""
    source = adapter.source
    if source.kind == "imagePath":
        return source.location
    if source.kind == "pvc":
        if spec.source.kind == "pvc" and spec.source.location == source.location:  # the model's claim
            return posixpath.join(MODEL_DIR, source.path) if source.path else MODEL_DIR
        return posixpath.join(ADAPTER_DIR, "pvc", source.location, source.path).rstrip("/")
    if source.kind == "hostPath":
        return posixpath.join(ADAPTER_DIR, "host", adapter.name)
    return adapter_download_folder(spec, adapter)


def adapter_download_folder(spec: ServiceSpec, adapter: Adapter) -> str:
    """The folder `pagoda download` fills with a uri adapter: in the model cache, or the pod's own."""
    if spec.cache is not None:
        return posixpath.join(MODEL_DIR, CACHED_ADAPTERS, adapter.name)
    return posixpath.join(DOWNLOADED, adapter.name)


def describe_source(source: ModelSource) -> str:
    """A source in one line, as status.adapters shows it."""
    if source.kind == "pvc":
        return f"pvc:{source.location}" + (f"/{source.path}" if source.path else "")
    if source.kind == "uri":
        return source.location
    return f"{source.kind}:{source.location}"


def model_path(spec: ServiceSpec) -> str:
    """What the server loads (--model)."""
    source = spec.source
    if source.kind == "imagePath":
        return source.location
    if source.kind == "pvc":
        return posixpath.join(MODEL_DIR, source.path) if source.path else MODEL_DIR
    if source.kind == "hostPath":
        return posixpath.join(MODEL_DIR, posixpath.basename(source.location.rstrip("/")))
    return sources.served_path(source.location, download_folder(spec))


def download_folder(spec: ServiceSpec) -> str:
    """The folder `pagoda download` fills with a uri source (the init container's, or the cache Job's)."""
    return posixpath.join(MODEL_DIR, sources.folder_name(spec.source.location))


def download_env(spec: ServiceSpec, source: ModelSource | None = None) -> dict[str, Any]:
    """`env` and `envFrom` of a download container: spec.env (HF_ENDPOINT, proxies), the Hub token,
    and the source's credentials Secret as environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS).
    `source`: an adapter's (default: the model's)."""
    source = source or spec.source
    env: list[dict[str, Any]] = [{"name": "HOME", "value": "/tmp"}, *spec.env]
    if source.token_secret is not None:
        name, key = source.token_secret
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
    fields: dict[str, Any] = {"env": env}
    if source.credentials_secret is not None:
        fields["envFrom"] = [{"secretRef": {"name": source.credentials_secret}}]
    return fields


def model_volumes(spec: ServiceSpec, config: OperatorConfig) -> tuple[list, list, list]:
    """(volumes, server mounts, init containers) that put the weights at model_path()."""
    source = spec.source
    if source.kind == "imagePath":
        return [], [], []
    if source.kind == "pvc":
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": source.location, "readOnly": True}}
        return [volume], [{"name": "model", "mountPath": MODEL_DIR, "readOnly": True}], []
    if source.kind == "hostPath":
        volume = {"name": "model", "hostPath": {"path": source.location}}
        return [volume], [{"name": "model", "mountPath": model_path(spec), "readOnly": True}], []
    if spec.cache is not None:  # filled by the cache Job (cache.py) before the Deployment exists
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": cache_name(spec), "readOnly": True}}
        return [volume], [{"name": "model", "mountPath": MODEL_DIR, "readOnly": True}], []
    # No cache: `pagoda download` (in the server image, nothing installed at start) fills an emptyDir
    # bounded by the checkpoint's size (parameters x 2 bytes as stored, + 10%) at every pod start.
    fetch = _fetch(spec, config, "fetch-model", source, download_folder(spec), ("model", MODEL_DIR))
    size_gib = -(-spec.model.num_params * 2 * 11 // (10 * GIB))
    volume = {"name": "model", "emptyDir": {"sizeLimit": f"{size_gib}Gi"}}
    return [volume], [{"name": "model", "mountPath": MODEL_DIR, "readOnly": True}], [fetch]


def _fetch(
    spec: ServiceSpec,
    config: OperatorConfig,
    name: str,
    source: ModelSource,
    target: str,
    volume: tuple[str, str],
) -> dict[str, Any]:
    """An init container: `pagoda download` of `source` into `target`, on the volume (name, mount path)."""
    *command, flag, folder = sources.download_command(source.location, target)
    return {
        "name": name,
        "image": config.downloader_image or spec.image or config.server_image,
        "command": command,
        "args": [flag, folder],
        **download_env(spec, source),
        "volumeMounts": [
            {"name": volume[0], "mountPath": volume[1]},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security(),
    }


def adapter_volumes(spec: ServiceSpec, config: OperatorConfig) -> tuple[list, list, list]:
    """(volumes, server mounts, init containers) that put each adapter at adapter_path(), read-only as
    the model: a claim once however many adapters it holds, a node path each, downloads into one
    emptyDir (with a model cache, the cache Job has fetched them: cache.py)."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    fetches: list[dict[str, Any]] = []
    claims: set[str] = {spec.source.location} if spec.source.kind == "pvc" else set()
    for i, adapter in enumerate(spec.adapters):
        source, name = adapter.source, f"adapter-{i}"
        if source.kind == "pvc" and source.location not in claims:
            claims.add(source.location)
            claim = {"claimName": source.location, "readOnly": True}
            volumes.append({"name": name, "persistentVolumeClaim": claim})
            path = posixpath.join(ADAPTER_DIR, "pvc", source.location)
            mounts.append({"name": name, "mountPath": path, "readOnly": True})
        elif source.kind == "hostPath":
            volumes.append({"name": name, "hostPath": {"path": source.location}})
            mounts.append({"name": name, "mountPath": adapter_path(spec, adapter), "readOnly": True})
        elif source.kind == "uri" and spec.cache is None:
            folder = adapter_download_folder(spec, adapter)
            fetches.append(_fetch(spec, config, f"fetch-{name}", source, folder, ("adapters", DOWNLOADED)))
    if fetches:
        # An adapter's size is unknown until fetched: room for its A and B at the largest rank in fp32
        # (how PEFT saves trained adapters), + 10%, at least 1 GiB each.
        per_adapter = spec.model.lora_slot_bytes(spec.engine.max_lora_rank, dtype_bytes=4) * 11 // 10
        size_gib = len(fetches) * max(1, -(-per_adapter // GIB))
        volumes.append({"name": "adapters", "emptyDir": {"sizeLimit": f"{size_gib}Gi"}})
        mounts.append({"name": "adapters", "mountPath": DOWNLOADED, "readOnly": True})
    return volumes, mounts, fetches
