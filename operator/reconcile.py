"""One level-based, idempotent reconcile of an InferenceService: observe, decide, apply, report.

Called the same way from create, update, resume, the periodic re-check and child events (see
handlers.py): it reads the nodes and the children, selects the profile again, applies the desired
children with server-side apply (which also undoes hand edits), deletes owned children that are no
longer wanted, refuses to touch objects it does not own, and returns the status to write and the
events to post. It never raises for a spec that cannot work: that is a status, not a retry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, cast

import kopf

from pagoda.operator import cache, drift, manifests, model_mounts, placement, router
from pagoda.operator import groups as lws_groups
from pagoda.operator import status as status_mod
from pagoda.operator.kube import FIELD_MANAGER, Kube, KubeError
from pagoda.operator.pods import PodIssue, diagnose
from pagoda.operator.profile import Decision
from pagoda.operator.spec import OperatorConfig, ServiceSpec, parse_spec

# Every child an InferenceService may own: (apiVersion, kind, name suffix), in apply order. A child's key
# is its kind and suffix ("Deployment", "Deployment-router"): its name is the service's plus the suffix.
CHILD_SLOTS = (
    ("v1", "Service", ""),
    ("policy/v1", "PodDisruptionBudget", ""),
    ("apps/v1", "Deployment", ""),
    (manifests.LWS_API_VERSION, "LeaderWorkerSet", manifests.LWS_SUFFIX),  # over several pods, no Deployment
    ("autoscaling/v2", "HorizontalPodAutoscaler", ""),
    ("networking.k8s.io/v1", "Ingress", ""),
    ("gateway.networking.k8s.io/v1", "HTTPRoute", ""),
    ("v1", "Service", "-servers"),
    ("v1", "ServiceAccount", "-router"),
    ("rbac.authorization.k8s.io/v1", "Role", "-router"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding", "-router"),
    ("policy/v1", "PodDisruptionBudget", "-router"),
    ("apps/v1", "Deployment", "-router"),
)
GROUPS = "LeaderWorkerSet" + manifests.LWS_SUFFIX  # its key
WORKLOAD_KINDS = {"Deployment", GROUPS, "HorizontalPodAutoscaler"}  # the model's, not the router's
# Removed as soon as the spec stops asking for them (the rest only with the workload or the profile).
OPTIONAL_KINDS = {"Ingress", "HTTPRoute"} | {kind + suffix for _, kind, suffix in CHILD_SLOTS if suffix}


def child_key(obj: Mapping[str, Any], service_name: str) -> str:
    return obj["kind"] + obj["metadata"]["name"].removeprefix(service_name)


_RUNNING = ("gpu", "precision", "tensorParallelSize", "pipelineParallelSize", "kvCacheDtype")


@dataclasses.dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Result:
    status: dict[str, Any]
    events: tuple[Event, ...] = ()
    retry_seconds: float | None = None  # the API failed for a reason that may pass: try again then
    decision: Decision | None = None  # what selection said this time (the operator's metrics count it)


@dataclasses.dataclass(frozen=True)
class ApplyFailure:
    """Why the desired children were not (all) applied: the API server's own words."""

    reason: Literal["InvalidSpec", "ApplyFailed", "LeaderWorkerSetNotInstalled"]
    message: str


APPLY_RETRY_SECONDS = 30.0
LWS_NOT_INSTALLED = (
    "the profile runs each replica over several pods as a LeaderWorkerSet ({api}), and this cluster does "
    "not serve that API: install LeaderWorkerSet (docs/operator.md, 'Models larger than one node'), or "
    "fit the model on one node (larger GPUs, or fp8); the next resync creates it once installed"
)


def workload_of(owned: Mapping[str, Any]) -> dict[str, Any] | None:
    """The pods' owner among the children: the LeaderWorkerSet, or the Deployment."""
    return owned.get(GROUPS) or owned.get("Deployment")


def _failure(obj: Mapping[str, Any], err: KubeError, is_dry_run: bool) -> ApplyFailure:
    # 400/422: the object itself is wrong (validation, admission); anything else may pass on a retry.
    reason: Literal["InvalidSpec", "ApplyFailed", "LeaderWorkerSetNotInstalled"] = (
        "InvalidSpec" if err.status in (400, 422) else "ApplyFailed"
    )
    stage = "refused by the API server" if is_dry_run else "failed to apply"
    message = f"{obj['kind']} {obj['metadata']['name']} {stage}: {err.message}"
    if err.status == 404 and obj["apiVersion"].startswith("gateway.networking.k8s.io/"):
        # No such API: the Gateway API's CRDs are not installed; nothing else in the spec can fix it.
        reason = "InvalidSpec"
        message = (
            f"spec.httpRoute: this cluster does not serve {obj['apiVersion']} {obj['kind']} (install the "
            "Gateway API CRDs and a Gateway controller, or remove spec.httpRoute)"
        )
    if err.status == 404 and obj["apiVersion"] == manifests.LWS_API_VERSION:
        # Not a fault of the spec, nor one a retry mends: a cluster-wide controller is missing.
        reason, message = "LeaderWorkerSetNotInstalled", LWS_NOT_INSTALLED.format(api=obj["apiVersion"])
    return ApplyFailure(reason, message)


def _warn_once(
    old_status: Mapping[str, Any], reason: str, message: str, condition: str = status_mod.READY
) -> list[Event]:
    """A Warning, unless the condition already says exactly this (the timer re-runs every minute)."""
    for cond in old_status.get("conditions") or ():
        if cond.get("type") == condition and (cond.get("reason"), cond.get("message")) == (reason, message):
            return []
    return [Event("Warning", reason, message)]


def missing_reference(kube: Kube, spec: ServiceSpec) -> PodIssue | None:
    """A PVC the spec names that does not exist: pods would wait for it without a word.

    Secrets are never read (the chart grants no access to them): the pods reference them, and a missing
    one is in the pods' status (`CreateContainerConfigError: secret "hf" not found`), which diagnose()
    quotes, for the download Job's pod too."""
    ns = spec.namespace
    if spec.source.kind == "pvc" and not kube.exists("v1", "PersistentVolumeClaim", ns, spec.source.location):
        message = (
            f'PersistentVolumeClaim "{spec.source.location}" (model.source.pvc) not found in namespace {ns}'
        )
        return PodIssue("PersistentVolumeClaimNotFound", message, True)
    return None


def is_owned(obj: Mapping[str, Any], owner_uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or ()
    return any(ref.get("uid") == owner_uid and ref.get("controller") for ref in refs)


def _profile_key(profile: Mapping[str, Any] | None) -> tuple:
    profile = profile or {}
    gpu = profile.get("gpu") or {}
    return (
        profile.get("selected"),
        gpu.get("product"),
        profile.get("precision"),
        profile.get("tensorParallelSize"),
    )


def _profile_events(old: Mapping[str, Any] | None, decision: Decision) -> list[Event]:
    new = status_mod.profile_status(decision)
    if _profile_key(old) == _profile_key(new) and (
        decision.is_selected or (old or {}).get("reason") == new["reason"]
    ):
        return []
    if decision.is_selected:
        return [Event("Normal", "ProfileSelected", decision.reason)]
    return [Event("Warning", "NoFittingGpu", decision.reason)]


def reconcile(body: Mapping[str, Any], kube: Kube, config: OperatorConfig, now: str) -> Result:
    meta = body["metadata"]
    uid, generation = meta["uid"], int(meta.get("generation", 1))
    old_status = body.get("status") or {}
    try:
        spec = parse_spec(body)
    except (ValueError, KeyError) as err:
        decision = Decision(False, f"invalid spec: {err}")
        invalid = ApplyFailure("InvalidSpec", str(err))
        result = status_mod.status(
            old=old_status,
            decision=decision,
            state=None,
            generation=generation,
            now=now,
            urls={},
            selector="",
            failure=(invalid.reason, invalid.message),
        )
        return Result(
            result, tuple(_warn_once(old_status, invalid.reason, invalid.message)), decision=decision
        )

    existing = {
        kind + suffix: kube.get(api, kind, spec.namespace, spec.name + suffix)
        for api, kind, suffix in CHILD_SLOTS
    }
    theirs = [f"{kind} {spec.name + suffix} exists and is not owned by this InferenceService"
              for _, kind, suffix in CHILD_SLOTS
              if (obj := existing[kind + suffix]) is not None and not is_owned(obj, uid)]  # fmt: skip
    owned = {kind: obj for kind, obj in existing.items() if obj is not None and is_owned(obj, uid)}
    spec_changed = old_status.get("observedGeneration") != generation
    current = None if spec_changed else placement.current_profile(workload_of(owned))
    decision = placement.decide(spec, kube.list_nodes(), kube.list_pods(), current)
    # The spec did not change and the workload runs, but its profile cannot be chosen now (its nodes
    # cordoned or gone, or nothing fits): keep serving what runs rather than reload weights elsewhere.
    running = status_mod.rollout(workload_of(owned))
    is_running = running is not None and running.desired > 0 and running.ready >= running.desired
    is_kept = (
        not spec_changed
        and workload_of(owned) is not None
        and (
            not decision.is_selected
            or (current is not None and is_running and not placement.is_same(decision, current))
        )
    )
    events = [] if is_kept and decision.is_selected else _profile_events(old_status.get("profile"), decision)

    failure: ApplyFailure | None = None
    cached: cache.CacheStatus | None = None
    if theirs:
        events += [Event("Warning", "Conflict", f"refusing to overwrite: {msg}") for msg in theirs]
    elif not is_kept:
        router_state = status_mod.rollout(owned.get("Deployment" + router.SUFFIX))
        router_ready = router_state is not None and router_state.ready > 0
        desired = manifests.children(spec, decision, config, router_ready) if decision.is_selected else []
        if spec.cache is not None and decision.is_selected:
            cached, failure, cache_events = _ensure_cache(kube, spec, config, body, old_status)
            events += cache_events
            if cached is None or cached.state != "Cached":  # no server pods before the weights are there
                desired = [obj for obj in desired if child_key(obj, spec.name) not in WORKLOAD_KINDS]
        for obj in desired:
            kopf.adopt(obj, owner=kopf.Body(cast(kopf.RawBody, dict(body))))
        applied, failure, apply_events = (
            _apply(kube, desired, owned, spec.name) if failure is None else ({}, failure, [])
        )
        events += apply_events
        owned |= applied
        if failure is None:
            # While a new revision is cached, the running Deployment serves on.
            wanted = {child_key(obj, spec.name) for obj in desired}
            wanted |= WORKLOAD_KINDS if cached_pending(cached) else set()
            for api, kind, suffix in CHILD_SLOTS:
                key, name = kind + suffix, spec.name + suffix
                if (
                    key in owned
                    and key not in wanted
                    and (key in WORKLOAD_KINDS or key in OPTIONAL_KINDS or not decision.is_selected)
                ):
                    kube.delete(api, kind, spec.namespace, name)
                    events.append(Event("Normal", "Deleted", f"deleted {kind} {name}: no longer wanted"))
                    owned.pop(key)
    if failure is not None:
        events += _warn_once(old_status, failure.reason, failure.message)

    workload = workload_of(owned)
    is_group = workload is not None and workload["kind"] == "LeaderWorkerSet"
    pods_selector = ",".join(f"{k}={v}" for k, v in manifests.selector_labels(spec).items())
    # What the scale subresource counts: a replica is a pod, or a group (its leader).
    selector = ",".join(f"{k}={v}" for k, v in manifests.server_selector(spec, is_group).items())
    pods: list[dict[str, Any]] | None = None
    issue = None  # why replicas are not (yet) ready: a missing reference, the cache, then the pods
    if failure is None and not theirs and (workload is not None or cached is not None):
        issue = missing_reference(kube, spec)
        if issue is None and cached_pending(cached):
            assert cached is not None
            is_failed = cached.state == "Failed"
            issue = PodIssue("CacheFailed" if is_failed else "Caching", cached.message, is_failed)
            if not is_failed:  # "downloading", unless its pod cannot start: no node for it, a missing Secret
                job_pods = kube.list_objects("v1", "Pod", spec.namespace, cache.pod_selector(cached.job_name))
                stuck = diagnose(job_pods)
                if stuck is not None and stuck.is_failure:
                    issue = PodIssue(stuck.reason, f"download Job {cached.job_name}: {stuck.message}", True)
        if workload is not None:
            pods = kube.list_pods(spec.namespace, pods_selector)
        if issue is None and pods is not None:
            issue = diagnose(pods)
        if issue is not None and issue.is_failure:
            events += _warn_once(old_status, issue.reason, issue.message, status_mod.DEGRADED)
    groups = None
    if is_group and workload is not None and pods is not None:
        recreations = kube.list_events(
            spec.namespace, "LeaderWorkerSet", workload["metadata"]["name"], lws_groups.RECREATE_REASON
        )
        groups = lws_groups.groups_status(workload, pods, recreations, old_status.get("groups") or ())
        events += [Event("Warning", "GroupRecreated", said) for said in lws_groups.news(old_status, groups)]
    result = status_mod.status(
        old=old_status,
        decision=decision,
        state=status_mod.rollout(workload),
        generation=generation,
        now=now,
        urls=manifests.urls(spec, config) if "Service" in owned else {"url": None, "grpcAddress": None},
        selector=selector,
        conflicts=theirs,
        is_kept=is_kept,
        failure=(failure.reason, failure.message) if failure else None,
        issue=issue,
        cache=cached.to_dict() if cached else None,
        router=status_mod.router_status(owned.get("Deployment" + router.SUFFIX), spec.router.policy),
        adapters=[
            {
                "name": a.name,
                "source": model_mounts.describe_source(a.source),
                "path": model_mounts.adapter_path(spec, a),
            }
            for a in spec.adapters
        ]
        or None,
        groups=groups,
    )
    if is_kept:  # what runs is still the old profile: show it, with why it could not be chosen now
        old_profile = old_status.get("profile") or {}
        result["profile"] = {**result["profile"], **{k: v for k, v in old_profile.items() if k in _RUNNING}}
    retry = APPLY_RETRY_SECONDS if failure is not None and failure.reason == "ApplyFailed" else None
    return Result(result, tuple(events), retry, decision)


def cached_pending(cached: cache.CacheStatus | None) -> bool:
    return cached is not None and cached.state != "Cached"


def _ensure_cache(
    kube: Kube,
    spec: ServiceSpec,
    config: OperatorConfig,
    body: Mapping[str, Any],
    old_status: Mapping[str, Any],
) -> tuple[cache.CacheStatus | None, ApplyFailure | None, list[Event]]:
    """The model cache's PVC and Job (created once: a Job's template is immutable), and its state."""
    owner = kopf.Body(cast(kopf.RawBody, dict(body)))
    claim = cache.pvc(spec)
    adapters = [
        (a, model_mounts.adapter_download_folder(spec, a), model_mounts.download_env(spec, a.source))
        for a in cache.uri_adapters(spec)
    ]
    job = cache.job(
        spec, config, model_mounts.download_folder(spec), model_mounts.download_env(spec), adapters
    )
    for obj in (claim, job):
        kopf.adopt(obj, owner=owner)
    events: list[Event] = []
    existing = kube.get("batch/v1", "Job", spec.namespace, job["metadata"]["name"])
    busy = None
    if existing is None:  # one Job writes the claim at a time: an unfinished one of another list goes
        jobs = kube.list_objects("batch/v1", "Job", spec.namespace, cache.selector(spec))
        for name in cache.superseded_jobs(spec, jobs):
            kube.delete("batch/v1", "Job", spec.namespace, name)
            events.append(
                Event("Normal", "Deleted", f"deleted Job {name}: its adapter list is no longer wanted")
            )
        busy = cache.writing_pod(spec, kube.list_objects("v1", "Pod", spec.namespace, cache.selector(spec)))
    for obj in (claim, job) if existing is None and busy is None else (claim,):
        try:
            applied = kube.apply(obj)
        except KubeError as err:
            return None, _failure(obj, err, is_dry_run=False), events
        if obj is job:
            existing = applied
            name = job["metadata"]["name"]
            events.append(Event("Normal", "Caching", f"created PVC and download Job {name}"))
    now = cache.state(spec, existing, waiting_for=busy)
    if now.state == "Failed":
        pods = kube.list_objects("v1", "Pod", spec.namespace, cache.pod_selector(now.job_name))
        now = cache.state(spec, existing, cache.last_words(pods))
    # The weights of other revisions, and the Jobs of other adapter lists, are no longer needed
    # (pvc-protection waits for old pods).
    if now.state == "Cached":
        for api, kind in (("batch/v1", "Job"), ("v1", "PersistentVolumeClaim")):
            found = kube.list_objects(api, kind, spec.namespace, cache.selector(spec))
            for name in cache.stale(spec, kind, found):
                kube.delete(api, kind, spec.namespace, name)
                events.append(
                    Event("Normal", "Deleted", f"deleted {kind} {name}: a cache of another revision")
                )
    before = (old_status.get("cache") or {}).get("state")
    if now.state != before and now.state == "Cached":  # a failure is warned of with the other issues
        events.append(Event("Normal", "Cached", now.message))
    return now, None, events


def _apply(
    kube: Kube, desired: list[dict[str, Any]], owned: Mapping[str, dict[str, Any]], service_name: str
) -> tuple[dict[str, dict[str, Any]], ApplyFailure | None, list[Event]]:
    """Dry-run every child, then apply them all: a child the API server refuses leaves none half-made.

    Returns the applied objects by key (child_key), the failure if any, and the Created/RollingOut events.
    """
    replaces: dict[str, dict[str, Any]] = {}  # key -> PUT body: drift that wedges apply itself
    for obj in desired:
        if _binds_a_role_to_come(obj, desired, owned, service_name):
            continue  # its Role is applied just before it; checked then
        try:
            kube.apply(obj, dry_run=True)
        except KubeError as err:
            live = owned.get(child_key(obj, service_name))
            if live is None or err.status != 422 or not drift.foreign_spec_fields(live, FIELD_MANAGER, obj):
                return {}, _failure(obj, err, is_dry_run=True), []
            body = drift.replacement(obj, live)
            try:
                kube.replace(body, dry_run=True)
            except KubeError:
                return {}, _failure(obj, err, is_dry_run=True), []  # the apply's words say more
            replaces[child_key(obj, service_name)] = body
    applied: dict[str, dict[str, Any]] = {}
    events: list[Event] = []
    for obj in desired:
        kind, name, key = obj["kind"], obj["metadata"]["name"], child_key(obj, service_name)
        try:
            if key in replaces:
                found = drift.foreign_spec_fields(owned[key], FIELD_MANAGER, obj)
                applied[key] = kube.replace(replaces[key])
            else:
                applied[key] = kube.apply(obj)
                found = drift.foreign_spec_fields(applied[key], FIELD_MANAGER, obj)
                if found:  # applied, but what others added stays: replace it
                    applied[key] = kube.replace(drift.replacement(obj, applied[key]))
        except KubeError as err:
            return applied, _failure(obj, err, is_dry_run=False), events
        if found:
            said = f"replaced {kind} {name}: {drift.describe(found)} changed by hand, which apply cannot undo"
            events.append(Event("Normal", "DriftCorrected", said))
        before = owned.get(key)
        if kind == "Deployment" and before is not None and _template_changed(before, applied[key]):
            events.append(Event("Normal", "RollingOut", f"rolling out Deployment {name}"))
        if before is None:
            events.append(Event("Normal", "Created", f"created {kind} {name}"))
    return applied, None, events


def _binds_a_role_to_come(
    obj: Mapping[str, Any], desired: list[dict[str, Any]], owned: Mapping[str, Any], service_name: str
) -> bool:
    """A RoleBinding to a Role of `desired` that does not exist yet: the API server's dry run of it looks
    the Role up (RBAC's escalation check) and refuses it as not found, so it can only be checked once the
    Role is applied."""
    if obj["kind"] != "RoleBinding" or obj["roleRef"]["kind"] != "Role":
        return False
    role = next(
        (o for o in desired if o["kind"] == "Role" and o["metadata"]["name"] == obj["roleRef"]["name"]), None
    )
    return role is not None and child_key(role, service_name) not in owned


def _template_changed(before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
    return before.get("metadata", {}).get("generation") != after.get("metadata", {}).get("generation") and (
        before.get("spec", {}).get("template") != after.get("spec", {}).get("template")
    )
