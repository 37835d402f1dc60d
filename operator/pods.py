"""Why pods do not run, from their status: the scheduler's and the kubelet's own words. Pure.

A Deployment only counts replicas; the reason a replica is not ready lives in its pod: the
PodScheduled condition (`0/8 nodes are available: 1 Insufficient nvidia.com/gpu ...`, a missing
PersistentVolumeClaim), a container waiting to start (`ImagePullBackOff`, a missing Secret in
`CreateContainerConfigError`), a crash loop (with the container's last message), or a container that
runs but is not ready yet (loading the model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

_IMAGE = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
_CONFIG = ("CreateContainerConfigError", "CreateContainerError")
MAX_MESSAGE = 400  # a crash's last message can be a whole traceback: keep its end


@dataclasses.dataclass(frozen=True)
class PodIssue:
    reason: str  # CamelCase, for a condition
    message: str
    is_failure: bool  # False: not ready yet, and nothing is wrong (loading)


def _tail(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else "..." + text[-MAX_MESSAGE:]


def _unschedulable(pod: Mapping[str, Any]) -> PodIssue | None:
    for cond in (pod.get("status") or {}).get("conditions") or ():
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            message = cond.get("message") or cond.get("reason") or "not scheduled"
            reason = "Unschedulable"
            if "persistentvolumeclaim" in message.lower():
                reason = "PersistentVolumeClaimNotReady"
            name = pod["metadata"]["name"]
            return PodIssue(reason, f"pod {name} cannot be scheduled: {_tail(message)}", True)
    return None


def _container(pod: Mapping[str, Any], status: Mapping[str, Any], is_init: bool) -> PodIssue | None:
    name = f"pod {pod['metadata']['name']} {'init ' if is_init else ''}container {status.get('name')}"
    state = status.get("state") or {}
    waiting = state.get("waiting") or {}
    why = waiting.get("reason", "")
    if why in _IMAGE:
        return PodIssue("ImagePullFailed", f"{name}: {why}: {_tail(waiting.get('message', ''))}", True)
    if why in _CONFIG:
        return PodIssue("ContainerConfigError", f"{name}: {_tail(waiting.get('message', why))}", True)
    last = (status.get("lastState") or {}).get("terminated") or {}
    if why == "CrashLoopBackOff" or (
        last and int(status.get("restartCount", 0)) > 0 and not status.get("ready")
    ):
        exit_code = last.get("exitCode", "?")
        said = last.get("message") or last.get("reason") or ""
        restarts = status.get("restartCount", 0)
        text = f"{name} crashed (exit code {exit_code}, {restarts} restarts)" + (
            f": {_tail(said)}" if said else ""
        )
        return PodIssue("CrashLoop", text, True)
    if is_init and "running" in state:
        return PodIssue("Initializing", f"{name} is running (fetching the model)", False)
    if not is_init and "running" in state and not status.get("ready"):
        since = state["running"].get("startedAt", "")
        return PodIssue("Loading", f"{name} is loading the model (running since {since})", False)
    return None


def diagnose(pods: Iterable[Mapping[str, Any]]) -> PodIssue | None:
    """The most telling problem among the pods: failures first, then not-ready-yet; None if all run."""
    issues: list[PodIssue] = []
    for pod in pods:
        if pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        status = pod.get("status") or {}
        found = _unschedulable(pod)
        if found is None:
            for is_init, key in ((True, "initContainerStatuses"), (False, "containerStatuses")):
                for container in status.get(key) or ():
                    found = found or _container(pod, container, is_init)
        if found is not None:
            issues.append(found)
    issues.sort(key=lambda i: not i.is_failure)
    return issues[0] if issues else None
