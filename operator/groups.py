"""status.groups: the LeaderWorkerSet groups of a model over several pods, their members, and what
happened when one was recreated. Pure.

LWS names a group after its leader (`<name>-<index>`) and labels every pod with its group's index, its
own index in the group (the leader's is 0) and the template revision. Under RecreateGroupOnPodRestart a
stage that dies takes its group with it: LWS deletes the leader (its workers go with it) and posts a
`RecreateGroup` event on the LeaderWorkerSet ("Worker pod llm-0-1 failed, deleted leader pod llm-0 to
recreate group 0"). Events expire (an hour by default), so the count lives in the status: a group whose
leader was created anew on the same template revision was recreated; a new revision is a rollout.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pagoda.operator.manifests import WORKER_INDEX_LABEL

GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
REVISION_LABEL = "leaderworkerset.sigs.k8s.io/template-revision-hash"
RECREATE_REASON = "RecreateGroup"  # LWS's pod controller, on the LeaderWorkerSet
LEADER_REPLACED = "the leader pod was replaced (deleted, evicted or its node lost), and its workers with it"


def _time(text: str | None) -> datetime.datetime | None:
    try:
        return datetime.datetime.fromisoformat(text) if text else None
    except ValueError:
        return None


def _event_time(event: Mapping[str, Any]) -> datetime.datetime | None:
    """When it last happened: events.k8s.io's series or eventTime, or core/v1's lastTimestamp."""
    series = event.get("series") or {}
    for text in (
        series.get("lastObservedTime"),
        event.get("lastTimestamp"),
        event.get("eventTime"),
        (event.get("metadata") or {}).get("creationTimestamp"),
    ):
        if (when := _time(text)) is not None:
            return when
    return None


def why_recreated(events: Iterable[Mapping[str, Any]], index: int, since: str | None) -> str:
    """The newest RecreateGroup event's words for group `index` after `since`, else LEADER_REPLACED."""
    after = _time(since)
    found: list[tuple[datetime.datetime, str]] = []
    for event in events:
        message, when = str(event.get("message") or event.get("note") or ""), _event_time(event)
        if (
            message.endswith(f"recreate group {index}")
            and when is not None
            and (after is None or when >= after)
        ):
            found.append((when, message))
    return max(found)[1] if found else LEADER_REPLACED


def _is_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def groups_status(
    lws: Mapping[str, Any],
    pods: Iterable[Mapping[str, Any]],
    events: Iterable[Mapping[str, Any]],
    old: Sequence[Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """One entry per group: its leader and workers (pods not being deleted), how many are ready, when
    its leader started on which revision, and how often it was recreated, with the last reason."""
    name = lws["metadata"]["name"]
    spec = lws.get("spec") or {}
    size = int((spec.get("leaderWorkerTemplate") or {}).get("size", 1))
    before = {g.get("name"): g for g in old}
    events = list(events)
    members: dict[int, list[Mapping[str, Any]]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        index = (meta.get("labels") or {}).get(GROUP_INDEX_LABEL, "")
        if index.isdigit() and not meta.get("deletionTimestamp"):
            members.setdefault(int(index), []).append(pod)
    out = []
    for index in sorted(set(range(int(spec.get("replicas", 1)))) | set(members)):
        group, found = f"{name}-{index}", members.get(index, [])
        leader = next((p for p in found if p["metadata"]["labels"].get(WORKER_INDEX_LABEL) == "0"), None)
        prior = before.get(group) or {}
        entry: dict[str, Any] = {
            "name": group,
            "leader": leader["metadata"]["name"] if leader else None,
            "workers": sorted(p["metadata"]["name"] for p in found if p is not leader),
            "size": size,
            "readyPods": sum(_is_ready(p) for p in found),
            "startedAt": prior.get("startedAt"),
            "revision": prior.get("revision"),
            "recreations": int(prior.get("recreations", 0)),
            "lastRecreation": prior.get("lastRecreation"),
        }
        if leader is not None:
            started = leader["metadata"].get("creationTimestamp")
            revision = leader["metadata"]["labels"].get(REVISION_LABEL)
            was = prior.get("startedAt")
            if was and started != was and revision == prior.get("revision"):
                entry["recreations"] += 1
                entry["lastRecreation"] = {"time": started, "reason": why_recreated(events, index, was)}
            entry["startedAt"], entry["revision"] = started, revision
        out.append(entry)
    return out


def news(old_status: Mapping[str, Any], groups: Sequence[Mapping[str, Any]]) -> list[str]:
    """What to tell in an event: each group recreated since the status was last written."""
    before = {g.get("name"): int(g.get("recreations", 0)) for g in old_status.get("groups") or ()}
    said = []
    for group in groups:
        count = int(group["recreations"])
        if count > before.get(group["name"], 0) and group.get("lastRecreation"):
            times = "once" if count == 1 else f"{count} times"
            said.append(
                f"group {group['name']} recreated ({times} so far): {group['lastRecreation']['reason']}"
            )
    return said
