"""Drift that apply cannot undo, read from managedFields as the API server writes them (the shapes below are
those of a Service and a Deployment after `kubectl edit`; e2e/test_operator.py makes them for real)."""

from __future__ import annotations

import json

from pagoda.operator import drift

OPERATOR = "pagoda-operator"


def port_key(port: int) -> str:
    return "k:" + json.dumps({"port": port, "protocol": "TCP"}, separators=(",", ":"))


def entry(manager: str, fields: dict, operation: str = "Update", subresource: str | None = None) -> dict:
    out = {"manager": manager, "operation": operation, "apiVersion": "v1", "fieldsType": "FieldsV1"}
    out["fieldsV1"] = fields
    if subresource:
        out["subresource"] = subresource
    return out


PORT_FIELDS = {".": {}, "f:name": {}, "f:port": {}, "f:protocol": {}, "f:targetPort": {}}
OURS = entry(
    OPERATOR,
    {
        "f:metadata": {"f:labels": {"f:app.kubernetes.io/name": {}}},
        "f:spec": {
            "f:ports": {port_key(8000): PORT_FIELDS, port_key(8001): PORT_FIELDS},
            "f:selector": {"f:app.kubernetes.io/instance": {}},
        },
    },
    operation="Apply",
)
DESIRED = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "svc", "namespace": "ns", "labels": {"app.kubernetes.io/name": "pagoda"}},
    "spec": {"ports": [{"name": "http", "port": 8000}], "selector": {"app.kubernetes.io/instance": "svc"}},
}


def service(*entries: dict, spec: dict | None = None) -> dict:
    meta = {"name": "svc", "namespace": "ns", "resourceVersion": "42", "managedFields": list(entries)}
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec or {}}


def test_a_port_renamed_by_hand_is_found_and_named() -> None:
    edit = entry("kubectl-edit", {"f:spec": {"f:ports": {port_key(9000): PORT_FIELDS}}})
    found = drift.foreign_spec_fields(service(OURS, edit), OPERATOR, DESIRED)
    assert found == {
        "spec.ports[port=9000,protocol=TCP]": "kubectl-edit",
        "spec.ports[port=9000,protocol=TCP].name": "kubectl-edit",
        "spec.ports[port=9000,protocol=TCP].port": "kubectl-edit",
        "spec.ports[port=9000,protocol=TCP].protocol": "kubectl-edit",
        "spec.ports[port=9000,protocol=TCP].targetPort": "kubectl-edit",
    }
    assert drift.describe(found) == (
        "spec.ports[port=9000,protocol=TCP] (kubectl-edit), spec.ports[port=9000,protocol=TCP].name "
        "(kubectl-edit), spec.ports[port=9000,protocol=TCP].port (kubectl-edit), "
        "spec.ports[port=9000,protocol=TCP].protocol (kubectl-edit), "
        "spec.ports[port=9000,protocol=TCP].targetPort (kubectl-edit)"
    )


def test_a_key_added_to_a_granular_map_is_found() -> None:
    # (The shape of a pod template label added by hand; a Service's selector is atomic in the API
    # server, which a force apply takes back whole, so no such entry outlives the next apply.)
    patch = entry("kubectl-patch", {"f:spec": {"f:selector": {"f:tier": {}}}})
    found = drift.foreign_spec_fields(service(OURS, patch), OPERATOR, DESIRED)
    assert found == {"spec.selector.tier": "kubectl-patch"}


def test_what_is_not_drift() -> None:
    # A field both own (the operator took it back with force, or the other set the same value).
    shared = entry("kubectl-edit", {"f:spec": {"f:ports": {port_key(8000): {"f:name": {}}}}})
    # Metadata others add, and what subresources write (the HPA through scale, the controllers' status).
    labels = entry("argocd", {"f:metadata": {"f:labels": {"f:team": {}}}})
    scale = entry("kube-controller-manager", {"f:spec": {"f:replicas": {}}}, subresource="scale")
    status = entry("kube-controller-manager", {"f:status": {"f:loadBalancer": {}}}, subresource="status")
    assert drift.foreign_spec_fields(service(OURS, shared, labels, scale, status), OPERATOR, DESIRED) == {}
    # The operator's own entries, whatever the operation (a replace writes an Update entry).
    ours_update = entry(OPERATOR, {"f:spec": {"f:sessionAffinity": {}}})
    assert drift.foreign_spec_fields(service(OURS, ours_update), OPERATOR, DESIRED) == {}


def test_replicas_are_drift_only_where_the_operator_sets_them() -> None:
    deployment = {"kind": "Deployment", "spec": {"template": {}}}
    restart = {"f:template": {"f:metadata": {"f:annotations": {"f:kubectl.kubernetes.io/restartedAt": {}}}}}
    hand = entry("kubectl-edit", {"f:spec": {"f:replicas": {}, **restart}})
    live = {"kind": "Deployment", "metadata": {"managedFields": [hand]}, "spec": {"replicas": 3}}
    assert drift.foreign_spec_fields(live, OPERATOR, deployment) == {}  # the HPA's; a rollout restart
    fixed = {"kind": "Deployment", "spec": {"replicas": 2, "template": {}}}
    assert drift.foreign_spec_fields(live, OPERATOR, fixed) == {"spec.replicas": "kubectl-edit"}


def test_the_replacement_keeps_what_the_server_and_others_hold() -> None:
    live = service(
        spec={
            "clusterIP": "10.0.0.7",
            "clusterIPs": ["10.0.0.7"],
            "ipFamilies": ["IPv4"],
            "ipFamilyPolicy": "SingleStack",
            "ports": [{"name": "http", "port": 9000}],
            "selector": {"app.kubernetes.io/instance": "svc", "tier": "x"},
            "sessionAffinity": "ClientIP",
        }
    )
    live["metadata"] |= {"labels": {"team": "a", "app.kubernetes.io/name": "other"}, "finalizers": ["f/x"]}
    live["metadata"]["annotations"] = {"note": "kept"}
    body = drift.replacement(DESIRED, live)
    assert body["spec"] == {
        "ports": [{"name": "http", "port": 8000}],
        "selector": {"app.kubernetes.io/instance": "svc"},
        "clusterIP": "10.0.0.7",
        "clusterIPs": ["10.0.0.7"],
        "ipFamilies": ["IPv4"],
        "ipFamilyPolicy": "SingleStack",
    }
    assert body["metadata"] == {
        "name": "svc",
        "namespace": "ns",
        "labels": {"team": "a", "app.kubernetes.io/name": "pagoda"},  # the operator's value wins
        "annotations": {"note": "kept"},
        "finalizers": ["f/x"],
        "resourceVersion": "42",
    }
    assert DESIRED["spec"] == {  # the desired object is not touched
        "ports": [{"name": "http", "port": 8000}],
        "selector": {"app.kubernetes.io/instance": "svc"},
    }
    deployment = {"kind": "Deployment", "metadata": {"name": "d"}, "spec": {"template": {"spec": {}}}}
    live_dep = {"metadata": {"resourceVersion": "7"}, "spec": {"replicas": 5, "template": {"spec": {}}}}
    assert drift.replacement(deployment, live_dep)["spec"] == {"template": {"spec": {}}, "replicas": 5}
    set_count = {"kind": "Deployment", "metadata": {"name": "d"}, "spec": {"replicas": 2, "template": {}}}
    assert drift.replacement(set_count, live_dep)["spec"]["replicas"] == 2


def test_an_event_names_at_most_five_paths() -> None:
    found = {f"spec.selector.k{i}": "kubectl-edit" for i in range(7)}
    text = drift.describe(found)
    assert text.endswith("spec.selector.k4 (kubectl-edit) and 2 more") and text.count("(kubectl-edit)") == 5
