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

from pagoda.operator import manifests
from pagoda.operator import status as status_mod
from pagoda.operator.gpus import gpu_groups
from pagoda.operator.kube import Kube
from pagoda.operator.profile import Decision, select_profile
from pagoda.operator.spec import OperatorConfig, parse_spec

# Every kind an InferenceService may own, in apply order.
CHILD_KINDS = (
    ("v1", "Service"),
    ("policy/v1", "PodDisruptionBudget"),
    ("apps/v1", "Deployment"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"),
)
WORKLOAD_KINDS = {"Deployment", "HorizontalPodAutoscaler"}
_RUNNING = ("gpu", "precision", "tensorParallelSize", "kvCacheDtype")  # status.profile of a workload


@dataclasses.dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Result:
    status: dict[str, Any]
    events: tuple[Event, ...] = ()


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
        result = status_mod.status(
            old=old_status,
            decision=decision,
            state=None,
            generation=generation,
            now=now,
            urls={},
            selector="",
        )
        return Result(result, (Event("Warning", "InvalidSpec", str(err)),))

    groups = gpu_groups(kube.list_nodes(), spec.node_selector, spec.tolerations)
    decision = select_profile(spec.profile_request(), groups)
    events = _profile_events(old_status.get("profile"), decision)

    existing = {kind: kube.get(api, kind, spec.namespace, spec.name) for api, kind in CHILD_KINDS}
    theirs = [f"{kind} {spec.name} exists and is not owned by this InferenceService" for kind, obj in
              existing.items() if obj is not None and not is_owned(obj, uid)]  # fmt: skip
    owned = {kind: obj for kind, obj in existing.items() if obj is not None and is_owned(obj, uid)}
    # Nothing fits any more, but the spec did not change (a node went away): keep serving what runs.
    spec_changed = old_status.get("observedGeneration") != generation
    is_kept = not decision.is_selected and "Deployment" in owned and not spec_changed

    deployment = owned.get("Deployment")
    if theirs:
        events += [Event("Warning", "Conflict", f"refusing to overwrite: {msg}") for msg in theirs]
    elif not is_kept:
        desired = manifests.children(spec, decision, config) if decision.is_selected else []
        for obj in desired:
            kopf.adopt(obj, owner=kopf.Body(cast(kopf.RawBody, dict(body))))
            applied = kube.apply(obj)
            if obj["kind"] == "Deployment":
                before = owned.get("Deployment")
                if before is not None and _template_changed(before, applied):
                    events.append(Event("Normal", "RollingOut", f"rolling out Deployment {spec.name}"))
                deployment = applied
            if obj["kind"] not in owned:
                events.append(Event("Normal", "Created", f"created {obj['kind']} {spec.name}"))
        wanted = {obj["kind"] for obj in desired}
        for api, kind in CHILD_KINDS:
            if kind in owned and kind not in wanted and (kind in WORKLOAD_KINDS or not decision.is_selected):
                kube.delete(api, kind, spec.namespace, spec.name)
                events.append(Event("Normal", "Deleted", f"deleted {kind} {spec.name}: no longer wanted"))
                if kind == "Deployment":
                    deployment = None

    selector = ",".join(f"{k}={v}" for k, v in manifests.selector_labels(spec).items())
    result = status_mod.status(
        old=old_status,
        decision=decision,
        state=status_mod.rollout(deployment),
        generation=generation,
        now=now,
        urls=manifests.urls(spec, config),
        selector=selector,
        conflicts=theirs,
        is_kept=is_kept,
    )
    if is_kept:  # what runs is still the old profile: show it, with why it could not be chosen now
        old_profile = old_status.get("profile") or {}
        result["profile"] = {**result["profile"], **{k: v for k, v in old_profile.items() if k in _RUNNING}}
    return Result(result, tuple(events))


def _template_changed(before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
    return before.get("metadata", {}).get("generation") != after.get("metadata", {}).get("generation") and (
        before.get("spec", {}).get("template") != after.get("spec", {}).get("template")
    )
