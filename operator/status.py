"""The InferenceService status: conditions from the profile and the Deployment, pure functions.

Conditions follow the Kubernetes convention (metav1.Condition): CamelCase `reason`, a human
`message`, and `lastTransitionTime` that moves only when `status` flips. No phase state machine.

Reasons of Ready=False, first match wins (Degraded=True with the same reason where it is a fault):
InvalidSpec / ApplyFailed (the operator's or the API server's words: nothing half-applied), Conflict
(a child of that name is not ours), NoProfile (no GPU fits), PersistentVolumeClaimNotFound (named
in the spec, absent), Caching / CacheFailed (the model cache; while caching, the download pod's own
reason when it cannot start), then from the pods (Secrets are never read: a missing one is the
kubelet's ContainerConfigError): Unschedulable / PersistentVolumeClaimNotReady (the scheduler's
message), ImagePullFailed, ContainerConfigError, CrashLoop (the container's last message), Loading
and Initializing (not faults), RollingOut, ReplicasNotReady, ScaledToZero. ProfileSelected=True
KeptRunning: a running workload keeps its profile although a fresh selection would differ (a cordon
moves nothing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pagoda.operator.pods import PodIssue
from pagoda.operator.profile import Decision

READY, PROFILE_SELECTED, PROGRESSING, DEGRADED = "Ready", "ProfileSelected", "Progressing", "Degraded"
CONDITION_TYPES = (READY, PROFILE_SELECTED, PROGRESSING, DEGRADED)


@dataclasses.dataclass(frozen=True)
class Condition:
    type: str
    is_true: bool
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Rollout:
    """What the Deployment says about itself."""

    desired: int
    replicas: int
    ready: int
    is_complete: bool
    failure: str | None = None  # why the rollout cannot finish, if it cannot
    updated: int = 0  # replicas on the current pod template


def rollout(deployment: Mapping[str, Any] | None) -> Rollout | None:
    """A Deployment's, or a LeaderWorkerSet's, whose replicas are groups (a group is ready when each of its
    pods is; LWS counts no separate availability)."""
    if deployment is None:
        return None
    spec, status = deployment.get("spec") or {}, deployment.get("status") or {}
    desired = int(spec.get("replicas", 1))
    updated = int(status.get("updatedReplicas", 0))
    ready_key = "readyReplicas" if deployment.get("kind") == "LeaderWorkerSet" else "availableReplicas"
    available = int(status.get(ready_key, 0))
    total = int(status.get("replicas", 0))
    observed = int(status.get("observedGeneration", 0)) >= int(deployment["metadata"].get("generation", 0))
    failure = None
    for cond in status.get("conditions") or ():
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            failure = f"rollout stalled: {cond.get('message', '')}".strip()
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            failure = f"pods cannot be created: {cond.get('message', '')}".strip()
    is_complete = observed and updated == desired and total == desired and available == desired
    ready = int(status.get("readyReplicas", 0))
    return Rollout(desired, total, ready, is_complete, failure, updated if observed else 0)


def conditions(
    decision: Decision,
    state: Rollout | None,
    conflicts: Sequence[str] = (),
    is_kept: bool = False,
    failure: tuple[str, str] | None = None,
    issue: PodIssue | None = None,
) -> list[Condition]:
    """The four conditions for one observation.

    is_kept: no profile now, but the old workload runs on; failure: (reason, message) of a spec the
    operator could not parse or the API server refused, which wins over everything else; issue: why
    replicas are not ready (pods.diagnose, or a missing PVC/Secret).
    """
    selected = Condition(
        PROFILE_SELECTED,
        decision.is_selected,
        "Selected" if decision.is_selected else "NoFittingGpu",
        decision.reason,
    )
    if failure is not None and not decision.is_selected:  # e.g. an unknown model: not a GPU question
        selected = Condition(PROFILE_SELECTED, False, failure[0], failure[1])
    if is_kept and decision.is_selected:  # a profile fits, but not the one that runs: no move
        why = f"kept the running profile while its replicas are ready; now it would be: {decision.reason}"
        selected = Condition(PROFILE_SELECTED, True, "KeptRunning", why)
    if failure is not None:
        reason, message = failure
        return [
            selected,
            Condition(READY, False, reason, message),
            Condition(PROGRESSING, False, reason, message),
            Condition(DEGRADED, True, reason, message),
        ]
    if conflicts:
        message = "; ".join(conflicts)
        return [
            selected,
            Condition(READY, False, "Conflict", message),
            Condition(PROGRESSING, False, "Conflict", message),
            Condition(DEGRADED, True, "Conflict", message),
        ]
    if state is None and issue is not None and decision.is_selected:  # e.g. the model cache is filling
        return [
            selected,
            Condition(READY, False, issue.reason, issue.message),
            Condition(PROGRESSING, not issue.is_failure, issue.reason, issue.message),
            Condition(DEGRADED, issue.is_failure, issue.reason, issue.message),
        ]
    if state is None:
        why = "no workload: " + decision.reason if not decision.is_selected else "creating the Deployment"
        reason = "NoProfile" if not decision.is_selected else "Creating"
        return [
            selected,
            Condition(READY, False, reason, why),
            Condition(PROGRESSING, decision.is_selected, reason, why),
            Condition(DEGRADED, not decision.is_selected, reason, why),
        ]
    counts = f"{state.ready}/{state.desired} replicas ready"
    if state.desired == 0:
        ready = Condition(READY, False, "ScaledToZero", "0 replicas requested")
    elif state.is_complete and state.ready >= state.desired:
        ready = Condition(READY, True, "ReplicasReady", counts)
    elif issue is not None:
        ready = Condition(READY, False, issue.reason, f"{counts}; {issue.message}")
    elif state.ready >= state.desired:  # ready, but some of them from the previous template
        updated = f"{state.updated}/{state.desired} on the current spec"
        ready = Condition(READY, False, "RollingOut", f"{counts}, {updated}")
    else:
        ready = Condition(READY, False, "ReplicasNotReady", counts)
    if state.is_complete:
        progressing = Condition(PROGRESSING, False, "RolloutComplete", counts)
    else:
        progressing = Condition(PROGRESSING, True, "RollingOut", f"rolling out: {counts}")
    if state.failure:
        degraded = Condition(DEGRADED, True, "RolloutFailed", state.failure)
    elif issue is not None and issue.is_failure:
        degraded = Condition(DEGRADED, True, issue.reason, issue.message)
    elif is_kept and not decision.is_selected:
        degraded = Condition(DEGRADED, True, "NoFittingGpu", f"kept the running workload; {decision.reason}")
    else:
        degraded = Condition(DEGRADED, False, "AsExpected", counts)
    return [selected, ready, progressing, degraded]


def merge_conditions(
    old: Sequence[Mapping[str, Any]], new: Sequence[Condition], now: str, generation: int
) -> list[dict[str, Any]]:
    """As status.conditions: lastTransitionTime carried over unless the status flipped."""
    before = {c.get("type"): c for c in old or ()}
    out = []
    for cond in new:
        status = "True" if cond.is_true else "False"
        prior = before.get(cond.type)
        since = prior.get("lastTransitionTime") if prior and prior.get("status") == status else None
        out.append(
            {
                "type": cond.type,
                "status": status,
                "reason": cond.reason,
                "message": cond.message,
                "lastTransitionTime": since or now,
                "observedGeneration": generation,
            }
        )
    return out


def profile_status(decision: Decision) -> dict[str, Any]:
    """status.profile; keys that no longer apply are None so that a merge patch removes them."""
    out: dict[str, Any] = {"gpu": None, "precision": None, "tensorParallelSize": None, "kvCacheDtype": None}
    return out | decision.to_dict()


def router_status(deployment: Mapping[str, Any] | None, policy: str) -> dict[str, Any] | None:
    """status.router: the router Deployment in front of the servers (spec.router), None without one."""
    state = rollout(deployment)
    if deployment is None or state is None:
        return None
    name = deployment["metadata"]["name"]
    return {"name": name, "policy": policy, "replicas": state.replicas, "readyReplicas": state.ready}


def status(
    *,
    old: Mapping[str, Any],
    decision: Decision,
    state: Rollout | None,
    generation: int,
    now: str,
    urls: Mapping[str, str | None],
    selector: str,
    conflicts: Sequence[str] = (),
    is_kept: bool = False,
    failure: tuple[str, str] | None = None,
    issue: PodIssue | None = None,
    cache: Mapping[str, Any] | None = None,
    router: Mapping[str, Any] | None = None,
    adapters: Sequence[Mapping[str, Any]] | None = None,
    groups: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """status; `adapters`: status.adapters, the LoRA adapters the pods are told to serve (None: none, or
    a spec that could not be parsed); `groups`: status.groups, the LeaderWorkerSet groups (groups.py;
    None: the workload is a Deployment)."""
    conds = conditions(decision, state, conflicts, is_kept, failure, issue)
    return {
        "observedGeneration": generation,
        "conditions": merge_conditions(old.get("conditions") or (), conds, now, generation),
        "profile": profile_status(decision),
        "replicas": state.replicas if state else 0,
        "readyReplicas": state.ready if state else 0,
        "selector": selector,
        "cache": cache,  # None removes it (merge patch)
        "router": router,
        "adapters": None if adapters is None else [dict(a) for a in adapters],
        "groups": None if groups is None else [dict(g) for g in groups],
        **urls,
    }
