"""A model over several pods on the real node: an InferenceService whose profile needs two "nodes" runs
as a LeaderWorkerSet group (LeaderWorkerSet's own controller and webhooks, harness/lws.py), a leader and a
worker pod of the real server image whose ranks talk gloo over the pod network, found by name through
cluster DNS; it answers, and when the worker pod is deleted the group is recreated as one, answers again,
and the status says what happened.

Two "nodes" on one: the spec asks for `pipelineParallelSize: 2`, the same rendering the profile reaches by
itself for a model no node holds (the table tests cover that choice). Claiming fewer GPUs on the one real
node would change the profile of every other test's service on it, and two pods of one GPU each fit the
node's four (LeaderWorkerSet places a group's pods anywhere unless told to keep them apart).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from by_path import load_by_path

HERE = Path(__file__).resolve().parent
base = load_by_path("pagoda_e2e_test_real_pods_base", HERE / "test_real_pods.py")

# The first test's setup may bear the session's cold costs (real node, images, the LWS and CoreDNS build).
pytestmark = pytest.mark.timeout(1800)

NAME = "pp"  # its LeaderWorkerSet is pp-group, its pods pp-group-0 (the leader) and pp-group-0-1
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory) -> Iterator[object]:
    with base.host_operator(cluster, tmp_path_factory.mktemp("operator")) as host:
        yield host


def _groups(cluster, namespace: str) -> list[dict]:
    return (base.get(cluster, namespace, "inferenceservice", NAME).get("status") or {}).get("groups") or []


def _ready_group(cluster, namespace: str) -> dict | None:
    """The one group, when the service is Ready and both its pods are."""
    isvc = base.get(cluster, namespace, "inferenceservice", NAME)
    groups = (isvc.get("status") or {}).get("groups") or []
    ready = base.conditions(isvc).get("Ready", {}).get("status") == "True"
    return groups[0] if ready and len(groups) == 1 and groups[0]["readyPods"] == 2 else None


def _ask(url: str) -> str | None:
    try:
        return base.ask(url, timeout=120)
    except OSError:
        return None  # kube-proxy may not have the new leader's endpoint yet


def test_a_group_over_two_pods_serves_and_is_recreated_as_one(
    cluster, real_node, real_images, lws, operator, namespace
) -> None:
    isvc = base.inference_service(NAME, real_images["server"])
    isvc["spec"]["pipelineParallelSize"] = 2
    t0 = time.monotonic()
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(isvc))
    context = base.describe(cluster, namespace, operator)

    def context_with_lws() -> str:
        return context(NAME) + f"\nLeaderWorkerSet controller:\n{lws.tail()}"

    group = base.wait_for("the group Ready", lambda: _ready_group(cluster, namespace), 420, context_with_lws)
    started = time.monotonic() - t0
    status = base.get(cluster, namespace, "inferenceservice", NAME)["status"]
    profile = status["profile"]
    assert (profile["tensorParallelSize"], profile["pipelineParallelSize"]) == (1, 2), profile
    assert (group["name"], group["leader"], group["workers"]) == (
        "pp-group-0",
        "pp-group-0",
        ["pp-group-0-1"],
    )

    # The LeaderWorkerSet's pods, both on the real node, each with its place in the group (LWS's webhook).
    pods = {p["metadata"]["name"]: p for p in base.server_pods(cluster, namespace, NAME)}
    assert set(pods) == {"pp-group-0", "pp-group-0-1"}
    assert {p["spec"]["nodeName"] for p in pods.values()} == {real_node.name}
    leader, worker = pods["pp-group-0"], pods["pp-group-0-1"]
    assert leader["metadata"]["labels"][WORKER_INDEX] == "0"
    env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    assert env["LWS_LEADER_ADDRESS"] == f"pp-group-0.pp-group.{namespace}" and env["LWS_WORKER_INDEX"] == "1"
    assert leader["status"]["podIP"] != worker["status"]["podIP"]  # two network stacks
    # Only the leader serves: the Service's endpoints are its address alone.
    slices = base.get(cluster, namespace, "endpointslices", "-l", f"kubernetes.io/service-name={NAME}")
    addresses = {
        a for s in slices["items"] for e in s.get("endpoints") or () for a in e.get("addresses") or ()
    }
    assert addresses == {leader["status"]["podIP"]}
    url = base.service_url(cluster, namespace, NAME)
    assert "Paris" in base.wait_for("an answer from the group", lambda: _ask(url), 60, context_with_lws)

    # A stage dies: the whole group is recreated (RecreateGroupOnPodRestart), and the status says why.
    t1 = time.monotonic()
    cluster.kubectl("delete", "pod", "pp-group-0-1", "-n", namespace, "--wait=false")

    def recreated() -> dict | None:
        now = _ready_group(cluster, namespace)
        return now if now and now["recreations"] >= 1 and now["startedAt"] != group["startedAt"] else None

    again = base.wait_for("the group recreated and Ready", recreated, 420, context_with_lws)
    assert again["recreations"] == 1, again
    reason = again["lastRecreation"]["reason"]
    assert "Worker pod pp-group-0-1 failed, deleted leader pod pp-group-0 to recreate group 0" in reason, (
        again
    )
    assert "Paris" in base.wait_for(
        "an answer after the recreation", lambda: _ask(url), 120, context_with_lws
    )
    events = base.get(cluster, namespace, "events", "--field-selector", f"involvedObject.name={NAME}")
    said = [e["message"] for e in events["items"] if e["reason"] == "GroupRecreated"]
    assert said and "group pp-group-0 recreated (once so far)" in said[0], said
    again_s = time.monotonic() - t1
    print(f"group Ready {started:.0f}s after apply; recreated and Ready {again_s:.0f}s after the delete")
