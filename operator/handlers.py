"""kopf wiring: every trigger calls the same reconcile(); handlers hold no logic of their own.

Triggers: create, update and resume of an InferenceService; one operator-wide resync loop (the
periodic re-check of every object: capacity, hand edits nothing watched); and events on the children
it owns (a deleted Service comes back, Deployment progress reaches the status at once), on nodes and
on server pods.

No finalizer: kopf puts one on every object that has a timer or a daemon, and a finalizer outlives an
operator that is gone (`helm uninstall`, a crashed or scaled-down operator): deleting the object then
hangs. The children need none (owner references: the garbage collector removes them), so the resync
is a loop of the operator's own rather than a kopf timer per object.
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime
import logging
import threading
from collections.abc import Mapping
from typing import Any, cast

import kopf
from prometheus_client import CollectorRegistry

from pagoda.operator.kube import Kube, KubeError
from pagoda.operator.metrics import OperatorMetrics
from pagoda.operator.reconcile import Result, reconcile
from pagoda.operator.spec import GROUP, KIND, PLURAL, VERSION, OperatorConfig

RETRY_SECONDS = 10.0  # after an API error (kopf waits 60 s by default)
MANAGED = {"app.kubernetes.io/managed-by": "pagoda-operator"}
SERVER_PODS = MANAGED | {"app.kubernetes.io/component": "inference-server"}
CHILD_RESOURCES = (
    ("", "v1", "services"),
    ("apps", "v1", "deployments"),
    # Where LeaderWorkerSet is not installed at start, kopf logs that it cannot watch these (as for
    # httproutes); its pods are watched below, and the resync converges the rest.
    ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
    ("autoscaling", "v2", "horizontalpodautoscalers"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("networking.k8s.io", "v1", "ingresses"),
    # Where the Gateway API's CRDs are not installed at start, kopf logs that it cannot watch these
    # (scanning is off: resources are resolved once); the resync still converges the routes.
    ("gateway.networking.k8s.io", "v1", "httproutes"),
    ("batch", "v1", "jobs"),  # the model cache's download Job: Cached reaches the status at once
)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Reconciler:
    """Runs reconcile() for one object at a time and writes its status and events, under a lock.

    Status is written here, not through kopf's handler patch, so that the writes of the InferenceService
    handlers and of child events are serialised; the last status written is kept, because a trigger's
    body may predate it (and events would repeat). Every reconcile is measured (metrics.py); without
    metrics given, they go to a registry nobody serves.
    """

    def __init__(self, kube: Kube, config: OperatorConfig, metrics: OperatorMetrics | None = None) -> None:
        self.kube = kube
        self.config = config
        self.metrics = metrics or OperatorMetrics(CollectorRegistry())
        self._locks: dict[str, threading.Lock] = {}
        self._written: dict[str, dict[str, Any]] = {}
        self._guard = threading.Lock()
        # kopf posts events through context variables it sets only inside its own handlers; the resync
        # loop runs outside them, so it reconciles in a copy of the context a handler ran in.
        self._kopf_context: contextvars.Context | None = None

    def _lock(self, uid: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(uid, threading.Lock())

    def run(self, body: Mapping[str, Any]) -> Result | None:
        """Reconcile and report; raises kopf.TemporaryError (no traceback, one retry later) on ApplyFailed.

        Nothing is done for an object being deleted: garbage collection is removing its children, and
        re-applying them failed (ApplyFailed, a 30 s retry)."""
        if body["metadata"].get("deletionTimestamp"):
            return None
        self._kopf_context = self._kopf_context or contextvars.copy_context()
        result = self._run(body)
        if result.retry_seconds is not None:
            ready = next(c for c in result.status["conditions"] if c["type"] == "Ready")
            raise kopf.TemporaryError(ready["message"], delay=result.retry_seconds)
        return result

    def _run(self, body: Mapping[str, Any]) -> Result:
        meta = body["metadata"]
        uid = meta["uid"]
        with self._lock(uid), self.metrics.reconcile(uid) as outcome:
            known = self._written.get(uid)
            if known is not None:
                body = {**body, "status": {**(body.get("status") or {}), **known}}
            result = outcome.result = reconcile(body, self.kube, self.config, _now())
            try:
                self.kube.patch_status(meta["namespace"], meta["name"], result.status)
            except KubeError as err:
                if err.status != 404:  # deleted meanwhile: nothing to report to
                    raise
                outcome.is_gone = True
                return result
            self._written[uid] = result.status
            for event in result.events:
                try:
                    kopf.event(
                        kopf.Body(cast(kopf.RawBody, dict(body))),
                        type=event.type,
                        reason=event.reason,
                        message=event.message,
                    )
                except LookupError:  # no kopf context yet (a resync before any handler ran): the status
                    logging.getLogger(__name__).warning(
                        "event not posted: %s %s", event.reason, event.message
                    )
        return result

    def run_by_name(self, namespace: str, name: str, uid: str | None = None) -> None:
        """For child and pod events: read the owner fresh and reconcile it (uid: only if still that one)."""
        self._kopf_context = self._kopf_context or contextvars.copy_context()
        owner = self.kube.get_inference_service(namespace, name)
        if owner is None or owner["metadata"].get("deletionTimestamp"):
            return
        if uid is not None and owner["metadata"]["uid"] != uid:
            return
        self._run(owner)  # an event handler has no retry; the owner's own handlers and the resync do

    def run_all_as_kopf(self, namespaces: tuple[str, ...] = ()) -> None:
        """run_all in a copy of a kopf handler's context, so that its events are posted (the resync)."""
        if self._kopf_context is None:
            self.run_all(namespaces)
        else:
            self._kopf_context.copy().run(self.run_all, namespaces)

    def run_all(self, namespaces: tuple[str, ...] = ()) -> None:
        """For node changes and the resync: reconcile every InferenceService served (all namespaces when
        none given)."""
        for namespace in namespaces or (None,):
            for body in self.kube.list_inference_services(namespace):
                if not body["metadata"].get("deletionTimestamp"):
                    self._run(body)

    def run_for_claim(self, namespace: str, claim: str) -> None:
        """For PVC events: reconcile the InferenceServices of `namespace` whose model.source is that
        claim (so "PersistentVolumeClaimNotFound" comes and goes with it, not at the next resync)."""
        for body in self.kube.list_inference_services(namespace):
            pvc = ((body.get("spec") or {}).get("model") or {}).get("source", {}).get("pvc") or {}
            if pvc.get("claimName") == claim and not body["metadata"].get("deletionTimestamp"):
                self._run(body)

    def forget(self, uid: str) -> None:
        with self._guard:
            self._locks.pop(uid, None)
            self._written.pop(uid, None)
        self.metrics.forget(uid)


async def resync(reconciler: Reconciler, namespaces: tuple[str, ...], interval: float) -> None:
    """Every `interval` seconds, reconcile every InferenceService served; an API error waits for the next."""
    while True:
        await asyncio.sleep(interval)
        try:
            await asyncio.to_thread(reconciler.run_all_as_kopf, namespaces)
        except Exception:  # the next pass tries again; the handlers retry their own
            logging.getLogger(__name__).exception("resync pass failed")


def configure(settings: kopf.OperatorSettings) -> None:
    """Keep kopf's bookkeeping under our own group, post only our events, and need fewer permissions."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # No handler needs a finalizer (module docstring); kopf removes this one from objects an earlier
    # operator version left it on.
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.posting.level = logging.WARNING  # kopf's own "handler succeeded" lines are not events
    settings.scanning.disabled = True  # no CRD/namespace watching: serve the resources found at start


def node_fingerprint(node: Mapping[str, Any]) -> tuple:
    """What selection reads from a node; heartbeats and image lists change nothing of it."""
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    gpu_labels = sorted((k, v) for k, v in (meta.get("labels") or {}).items() if k.startswith("nvidia.com/"))
    ready = [c.get("status") for c in status.get("conditions") or () if c.get("type") == "Ready"]
    taints = sorted(
        (t.get("key", ""), t.get("value", ""), t.get("effect", "")) for t in spec.get("taints") or ()
    )
    allocatable = (status.get("allocatable") or {}).get("nvidia.com/gpu")
    return (tuple(gpu_labels), bool(spec.get("unschedulable")), tuple(taints), tuple(ready), allocatable)


def register(
    registry: kopf.OperatorRegistry, reconciler: Reconciler, namespaces: tuple[str, ...] = ()
) -> None:
    config = reconciler.config
    resource = dict(group=GROUP, version=VERSION, plural=PLURAL, registry=registry)

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)  # the same credentials as Kube.from_environment()

    @kopf.on.create(**resource, id="reconcile-create", backoff=RETRY_SECONDS)
    def on_create(body: kopf.Body, **_: Any) -> None:
        reconciler.run(body)

    @kopf.on.update(**resource, id="reconcile-update", backoff=RETRY_SECONDS)
    def on_update(body: kopf.Body, **_: Any) -> None:
        reconciler.run(body)

    @kopf.on.resume(**resource, id="reconcile-resume", backoff=RETRY_SECONDS)
    def on_resume(body: kopf.Body, **_: Any) -> None:
        reconciler.run(body)

    @kopf.on.startup(registry=registry, id="start_resync")
    async def start_resync(memo: kopf.Memo, **_: Any) -> None:
        memo["resync"] = asyncio.create_task(resync(reconciler, namespaces, config.resync_seconds))

    @kopf.on.cleanup(registry=registry, id="stop_resync")
    async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
        if (task := memo.get("resync")) is not None:
            task.cancel()

    @kopf.on.delete(**resource, id="forget", optional=True)
    def on_delete(uid: str, **_: Any) -> None:
        reconciler.forget(uid)  # the children go with garbage collection (owner references)

    for group, version, plural in CHILD_RESOURCES:

        @kopf.on.event(group, version, plural, labels=MANAGED, registry=registry, id=f"child-{plural}")
        def on_child(body: kopf.Body, **_: Any) -> None:
            for ref in body.metadata.get("ownerReferences") or ():
                if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(GROUP + "/"):
                    reconciler.run_by_name(str(body.metadata.namespace), ref["name"], ref["uid"])

    # Nodes: a cordon, a new GPU node or a changed label is seen in seconds, not at the next resync.
    # Only what selection reads counts (node_fingerprint); the first sight of each node is the baseline.
    seen: dict[str, tuple] = {}

    @kopf.on.event("", "v1", "nodes", registry=registry, id="nodes")
    def on_node(body: kopf.Body, type: str | None, **_: Any) -> None:
        name = str(body.metadata.name)
        fingerprint = () if type == "DELETED" else node_fingerprint(body)
        before = seen.get(name)
        seen[name] = fingerprint
        if (before is not None or type == "ADDED") and before != fingerprint:
            reconciler.run_all(namespaces)

    # A model's PVC (model.source.pvc) created or deleted after its InferenceService: the status names
    # it or stops naming it in seconds. kopf's first listing (type None) changes nothing.
    @kopf.on.event("", "v1", "persistentvolumeclaims", registry=registry, id="claims")
    def on_claim(body: kopf.Body, type: str | None, **_: Any) -> None:
        if type in ("ADDED", "DELETED"):
            reconciler.run_for_claim(str(body.metadata.namespace), str(body.metadata.name))

    # A pod's scheduling or container state changes nothing in its Deployment's status: watch the pods
    # (labelled by manifests.labels) so that "why not ready" reaches the status in seconds.
    @kopf.on.event("", "v1", "pods", labels=SERVER_PODS, registry=registry, id="server-pods")
    def on_pod(body: kopf.Body, **_: Any) -> None:
        instance = body.metadata.labels.get("app.kubernetes.io/instance")
        if instance:
            reconciler.run_by_name(str(body.metadata.namespace), instance)
