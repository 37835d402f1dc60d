"""Status says why pods do not run, in the scheduler's and the kubelet's words: a missing PVC, pods the
scheduler cannot place, an image that cannot be pulled (a kubelet's report, written here as kwok does
not simulate image pulls), and Ready/Degraded that agree with the pods.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from by_path import load_by_path

base = load_by_path("pagoda_e2e_test_operator_base", Path(__file__).with_name("test_operator.py"))
operator = base.operator  # the module-scoped fixture: chart installed, `pagoda operator` running


def conditions_of(cluster, namespace: str, name: str) -> dict[str, dict]:
    isvc = base.get(cluster, namespace, "inferenceservice", name)
    return {c["type"]: c for c in ((isvc or {}).get("status") or {}).get("conditions") or ()}


def wait_reason(
    cluster, namespace: str, name: str, kind: str, reason: str, op, message_has: str = ""
) -> dict[str, dict]:
    """The conditions once `kind` has `reason` (and a message holding `message_has`)."""

    def check() -> dict[str, dict] | None:
        conds = conditions_of(cluster, namespace, name)
        cond = conds.get(kind, {})
        return conds if cond.get("reason") == reason and message_has in cond.get("message", "") else None

    def context() -> str:
        return json.dumps(conditions_of(cluster, namespace, name), indent=1) + "\n" + op.tail()

    return base.wait_for(f"{name} {kind} reason {reason}", check, timeout=60, context=context)


def warnings(cluster, namespace: str, reason: str) -> list[str]:
    out = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", f"reason={reason}", "-o", "json"
    )
    return [e["message"] for e in json.loads(out.stdout)["items"] if e["type"] == "Warning"]


def test_a_missing_pvc_is_named_then_the_scheduler_is_quoted(cluster, namespace, operator) -> None:
    source = {"pvc": {"claimName": "models", "path": "llama"}}
    base.apply(
        cluster, namespace, base.small_service("nopvc", model={"name": "llama-3.1-8b", "source": source})
    )
    conds = wait_reason(cluster, namespace, "nopvc", "Degraded", "PersistentVolumeClaimNotFound", operator)
    assert conds["Degraded"]["status"] == "True" and conds["Ready"]["status"] == "False"
    message = f'PersistentVolumeClaim "models" (model.source.pvc) not found in namespace {namespace}'
    assert message in conds["Ready"]["message"]
    base.wait_for(  # kopf posts events from its own queue, after the status patch
        "the PersistentVolumeClaimNotFound Warning",
        lambda: warnings(cluster, namespace, "PersistentVolumeClaimNotFound") == [message],
        context=operator.tail,
    )
    # The claim exists but is never bound: the scheduler's own words reach the status.
    base.apply(cluster, namespace, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "none",
                 "resources": {"requests": {"storage": "1Gi"}}},
    })  # fmt: skip
    # The pod's scheduling condition may still hold the scheduler's words from before the claim existed
    # ("persistentvolumeclaim ... not found") until the scheduler tries the pod again: wait for the new.
    conds = wait_reason(
        cluster, namespace, "nopvc", "Degraded", "PersistentVolumeClaimNotReady", operator,
        message_has="PersistentVolumeClaim",
    )  # fmt: skip
    # Every node refuses it: 8 simulated GPU nodes, 9 once a test has joined the real node.
    assert re.search(r"cannot be scheduled: 0/\d+ nodes are available", conds["Degraded"]["message"])
    assert "PersistentVolumeClaim" in conds["Degraded"]["message"]


def test_an_unschedulable_pod_says_what_is_missing(cluster, namespace, operator) -> None:
    body = base.small_service("huge", resources={"requests": {"memory": "100Ti"}})
    base.apply(cluster, namespace, body)
    conds = wait_reason(cluster, namespace, "huge", "Ready", "Unschedulable", operator)
    assert conds["Ready"]["status"] == "False"
    assert conds["Ready"]["message"].startswith("0/1 replicas ready; pod huge-")
    assert "Insufficient memory" in conds["Ready"]["message"]
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "Unschedulable")
    isvc = base.get(cluster, namespace, "inferenceservice", "huge")
    assert isvc["status"]["url"].startswith("http://huge.")  # the Service exists


def test_image_pull_errors_and_recovery_reach_the_status(cluster, namespace, operator) -> None:
    base.apply(cluster, namespace, base.small_service("pull"))
    base.ready_service(cluster, namespace, "pull", operator)
    (pod,) = base.running_pods(cluster, namespace, "pull")
    name = pod["metadata"]["name"]
    waiting = {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "example.invalid/pagoda:0"'}
    container = {"name": "server", "ready": False, "restartCount": 0, "image": "x", "imageID": ""}
    status = {
        "conditions": [{"type": "Ready", "status": "False"}, {"type": "ContainersReady", "status": "False"}],
        "containerStatuses": [container | {"state": {"waiting": waiting}}],
    }
    cluster.kubectl(
        "patch", "pod", name, "-n", namespace, "--subresource=status", "-p", json.dumps({"status": status})
    )
    conds = wait_reason(cluster, namespace, "pull", "Ready", "ImagePullFailed", operator)
    assert conds["Ready"]["status"] == "False" and conds["Degraded"]["reason"] == "ImagePullFailed"
    assert 'ImagePullBackOff: Back-off pulling image "example.invalid/pagoda:0"' in conds["Ready"]["message"]
    # kopf posts events from a queue of its own, after the status patch: wait for it rather than race it.
    base.wait_for(
        "the ImagePullFailed Warning naming the pod",
        lambda: any(name in m for m in warnings(cluster, namespace, "ImagePullFailed")),
        context=operator.tail,
    )
    cluster.kubectl("delete", "pod", name, "-n", namespace, "--wait=false")  # the new pod pulls fine
    base.ready_service(cluster, namespace, "pull", operator)
    conds = conditions_of(cluster, namespace, "pull")
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("False", "AsExpected")
    assert conds["Ready"]["message"] == "1/1 replicas ready"


def test_server_pods_are_burstable_and_read_only_and_the_operator_avoids_gpu_nodes(
    cluster, namespace, operator
) -> None:
    base.apply(cluster, namespace, base.small_service("hygiene"))
    base.ready_service(cluster, namespace, "hygiene", operator)
    (pod,) = base.running_pods(cluster, namespace, "hygiene")
    assert pod["status"]["qosClass"] == "Burstable"  # computed by the API server from the requests
    (container,) = pod["spec"]["containers"]
    requests = container["resources"]["requests"]
    assert (requests["cpu"], requests["memory"]) == ("1", "6Gi")  # 8B fp8 at TP 1, from the model
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/tmp", "/home/pagoda/.cache"} <= mounts
    # The chart's operator Deployment (its pod simulated like any other) is kept off the GPU nodes.
    pods = base.get(cluster, base.RELEASE_NS, "pods", "-l", "app.kubernetes.io/name=pagoda")
    nodes = {p["spec"].get("nodeName") for p in pods["items"]}
    assert nodes == {"cpu-0"}, nodes
