"""Drift that server-side apply cannot undo, found from an object's managedFields. Pure.

Apply with `force` takes back every field the operator sets, but it never removes a field that another
manager added: a port entry a hand edit renamed (`kubectl edit` turned 8000 into 9000: the next apply
merges 8000 back beside it and the API server refuses two ports named `http`), a label added to a pod
template (a new rollout of pods the operator did not ask for). Such fields are the ones in `spec` that
a manager other than the operator owns and the operator does not. (A key added to a selector is not
one: selectors are atomic maps, which apply takes back whole.) The cure is a
replace (PUT) with the operator's object, keeping what the API server allocated or another controller
is meant to own.

Left alone on purpose: metadata (other tools label and annotate what they watch), the scale and status
subresources (the HPA, the controllers), `kubectl rollout restart`'s annotation, and the replica count
of a Deployment the operator renders without one (the HPA owns it).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from typing import Any

# Paths (as `path()` writes them) another manager may own without it being drift.
BENIGN = ("spec.template.metadata.annotations.kubectl.kubernetes.io/restartedAt",)
# What the API server allocated, by kind: a replace must carry it over (a Service's clusterIP is immutable).
ALLOCATED: dict[str, tuple[str, ...]] = {
    "Service": ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"),
}
MAX_LISTED = 5  # paths named in an event


def _leaves(fields: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The owned paths of a fieldsV1 tree: a `.` marks the node itself owned, an empty node is a leaf."""
    if not fields:
        yield prefix
        return
    for key, sub in fields.items():
        if key == ".":
            yield prefix
        else:
            yield from _leaves(sub or {}, (*prefix, key))


def path(parts: tuple[str, ...]) -> str:
    """`("f:spec", "f:ports", 'k:{"port":9000,"protocol":"TCP"}', "f:name")` -> `spec.ports[port=9000,
    protocol=TCP].name`."""
    out = ""
    for part in parts:
        kind, _, rest = part.partition(":")
        if kind == "k":
            keys = json.loads(rest)
            out += "[" + ",".join(f"{k}={v}" for k, v in keys.items()) + "]"
        elif kind == "v" or kind == "i":
            out += f"[{rest}]"
        else:
            out += ("." if out else "") + rest
    return out


def _owned(entry: Mapping[str, Any]) -> set[tuple[str, ...]]:
    return set(_leaves(entry.get("fieldsV1") or {}))


def foreign_spec_fields(live: Mapping[str, Any], manager: str, desired: Mapping[str, Any]) -> dict[str, str]:
    """Paths under `spec` that another manager owns and `manager` does not -> that manager's name.

    `desired` is what the operator applies: a Deployment without `spec.replicas` leaves them to others.
    """
    entries = (live.get("metadata") or {}).get("managedFields") or ()
    ours: set[tuple[str, ...]] = set()
    for entry in entries:
        if entry.get("manager") == manager and not entry.get("subresource"):
            ours |= _owned(entry)
    benign = set(BENIGN)
    if "replicas" not in (desired.get("spec") or {}):
        benign.add("spec.replicas")
    found: dict[str, str] = {}
    for entry in entries:
        if entry.get("manager") == manager or entry.get("subresource"):
            continue
        for leaf in _owned(entry):
            if not leaf or leaf[0] != "f:spec" or any(leaf[: i + 1] in ours for i in range(len(leaf))):
                continue
            name = path(leaf)
            if name not in benign:
                found.setdefault(name, str(entry.get("manager", "?")))
    return found


def replacement(desired: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
    """The body of a PUT that makes `live` the operator's object again.

    Carries over the resourceVersion (a replace of a changed object fails, and the next pass retries),
    what the API server allocated, the replica count when the operator sets none, the labels, annotations
    and finalizers others put on the object (desired wins on a clash).
    """
    body = copy.deepcopy(dict(desired))
    live_meta, meta = live.get("metadata") or {}, body.setdefault("metadata", {})
    meta["resourceVersion"] = live_meta.get("resourceVersion")
    for key in ("labels", "annotations"):
        merged = {**(live_meta.get(key) or {}), **(meta.get(key) or {})}
        if merged:
            meta[key] = merged
    if live_meta.get("finalizers"):
        meta["finalizers"] = list(live_meta["finalizers"])
    live_spec, spec = live.get("spec") or {}, body.setdefault("spec", {})
    for key in ALLOCATED.get(str(body.get("kind")), ()):
        if key in live_spec and key not in spec:
            spec[key] = copy.deepcopy(live_spec[key])
    is_workload = "template" in spec or "leaderWorkerTemplate" in spec  # a Deployment, a LeaderWorkerSet
    if "replicas" in live_spec and "replicas" not in spec and is_workload:
        spec["replicas"] = live_spec["replicas"]
    return body


def describe(found: Mapping[str, str]) -> str:
    """`spec.selector.tier (kubectl-edit), ...`, at most MAX_LISTED paths."""
    items = [f"{p} ({m})" for p, m in sorted(found.items())]
    more = len(items) - MAX_LISTED
    return ", ".join(items[:MAX_LISTED]) + (f" and {more} more" if more > 0 else "")
