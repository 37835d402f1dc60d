"""The kopf wiring: every trigger is registered, settings keep kopf's bookkeeping under our group."""

from __future__ import annotations

import copy

import kopf

from pagoda.operator.handlers import Reconciler, configure, register
from pagoda.operator.spec import OperatorConfig


def test_handlers_are_registered() -> None:
    registry = kopf.OperatorRegistry()
    register(registry, Reconciler(kube=None, config=OperatorConfig(resync_seconds=7)))  # type: ignore[arg-type]
    changing = {h.id: h for h in registry._changing.get_all_handlers()}
    assert {"reconcile-create", "reconcile-update", "reconcile-resume", "forget"} <= set(changing)
    assert changing["forget"].requires_finalizer is False  # garbage collection cleans up, not a handler
    # No timer or daemon: kopf would put a finalizer on every object, which outlives an uninstalled
    # operator (deleting the object hangs). The resync is the operator's own loop, started at startup.
    assert registry._spawning.get_all_handlers() == []
    assert not any(h.requires_finalizer for h in changing.values())
    activities = {h.id for h in registry._activities.get_all_handlers()}
    assert {"start_resync", "stop_resync"} <= activities
    watching = {h.id for h in registry._watching.get_all_handlers()}
    assert {f"child-{p}" for p in ("services", "deployments", "horizontalpodautoscalers")} <= watching
    assert {"server-pods", "nodes", "claims", "child-httproutes"} <= watching


def test_settings() -> None:
    settings = kopf.OperatorSettings()
    configure(settings)
    assert settings.persistence.finalizer == "serving.pagoda.dev/finalizer"
    assert settings.scanning.disabled is True


def test_the_resync_passes_over_every_object_and_outlives_a_failed_pass() -> None:
    import asyncio

    from pagoda.operator.handlers import resync

    class Counting:
        def __init__(self) -> None:
            self.calls: list[tuple[str, ...]] = []

        def run_all_as_kopf(self, namespaces: tuple[str, ...]) -> None:
            self.calls.append(namespaces)
            if len(self.calls) == 1:
                raise RuntimeError("the API server is away")

    counting = Counting()

    async def three_passes() -> None:
        task = asyncio.create_task(resync(counting, ("a", "b"), 0.01))  # type: ignore[arg-type]
        while len(counting.calls) < 3:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(asyncio.wait_for(three_passes(), 30))
    assert counting.calls[:3] == [("a", "b")] * 3


def test_node_fingerprint_ignores_heartbeats_and_sees_what_selection_reads() -> None:
    from pagoda.operator.handlers import node_fingerprint

    node = {
        "metadata": {"name": "n", "labels": {"nvidia.com/gpu.product": "NVIDIA-H200", "other": "a"}},
        "spec": {},
        "status": {
            "allocatable": {"nvidia.com/gpu": "8", "cpu": "8"},
            "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": "T1"}],
        },
    }
    before = node_fingerprint(node)
    node["status"]["conditions"][0]["lastHeartbeatTime"] = "T2"
    node["metadata"]["labels"]["other"] = "b"
    node["status"]["allocatable"]["cpu"] = "7"
    assert node_fingerprint(node) == before
    for change in (
        lambda n: n["spec"].update(unschedulable=True),
        lambda n: n["spec"].update(taints=[{"key": "k", "effect": "NoSchedule"}]),
        lambda n: n["status"]["allocatable"].update({"nvidia.com/gpu": "4"}),
        lambda n: n["metadata"]["labels"].update({"nvidia.com/gpu.product": "NVIDIA-H100"}),
        lambda n: n["status"]["conditions"][0].update(status="False"),
    ):
        changed = copy.deepcopy(node)
        change(changed)
        assert node_fingerprint(changed) != before


def test_an_object_being_deleted_is_not_reconciled() -> None:
    """Its children are being garbage-collected: re-applying them failed and held its deletion back
    (kube=None: any call to the API would raise here)."""
    reconciler = Reconciler(kube=None, config=OperatorConfig())  # type: ignore[arg-type]
    body = {
        "metadata": {"name": "x", "namespace": "ns", "uid": "u", "deletionTimestamp": "2026-12-01T00:00:00Z"}
    }
    assert reconciler.run(body) is None


def test_a_claim_event_reconciles_the_services_that_mount_it_and_no_other(monkeypatch) -> None:
    from fake_kube import FakeKube

    posted: list[str] = []  # kopf.event posts through the running operator's queue; none runs here
    monkeypatch.setattr(kopf, "event", lambda body, **kw: posted.append(body["metadata"]["name"]))

    def service(name: str, source: dict) -> dict:
        meta = {"name": name, "namespace": "ns", "uid": f"u-{name}", "generation": 1}
        return {"metadata": meta, "spec": {"model": {"name": "llama-3.1-8b", "source": source}}}

    class Listing(FakeKube):
        def list_inference_services(self, namespace: str | None = None) -> list[dict]:
            return [copy.deepcopy(b) for b in bodies if namespace in (None, b["metadata"]["namespace"])]

    bodies = [
        service("on-weights", {"pvc": {"claimName": "weights"}}),
        service("on-other", {"pvc": {"claimName": "other"}}),
        service("in-image", {"imagePath": "/models/llama"}),
    ]
    kube = Listing([])
    reconciler = Reconciler(kube=kube, config=OperatorConfig())  # type: ignore[arg-type]
    reconciler.run_for_claim("ns", "weights")
    assert set(kube.statuses) == {"on-weights"} and set(posted) == {"on-weights"}
    reconciler.run_for_claim("elsewhere", "weights")
    assert set(kube.statuses) == {"on-weights"}


def test_the_resync_posts_events_in_the_context_a_kopf_handler_ran_in(monkeypatch) -> None:
    """kopf.event reads context variables kopf sets only inside its handlers; the resync runs outside
    them (it failed whole on the first event before), so it runs in a copy of a handler's context."""
    import contextvars

    from fake_kube import FakeKube

    handler_only: contextvars.ContextVar[str] = contextvars.ContextVar("handler_only")
    posted: list[str] = []
    monkeypatch.setattr(kopf, "event", lambda body, **kw: posted.append(handler_only.get()))

    class Listing(FakeKube):
        def list_inference_services(self, namespace: str | None = None) -> list[dict]:
            meta = {"name": "llm", "namespace": "ns", "uid": "u-1", "generation": 1}
            return [
                {"metadata": meta, "spec": {"model": {"name": "llama-3.1-8b", "source": {"imagePath": "/m"}}}}
            ]

        def get_inference_service(self, namespace: str, name: str) -> dict | None:
            return None

    reconciler = Reconciler(kube=Listing([]), config=OperatorConfig())  # type: ignore[arg-type]
    reconciler.run_all_as_kopf()  # no handler has run: the events are dropped, the pass completes
    assert posted == [] and reconciler.kube.statuses  # type: ignore[attr-defined]

    def in_a_handler() -> None:
        handler_only.set("kopf's queue")
        reconciler.run_by_name("ns", "missing")  # a handler call captures its context

    contextvars.copy_context().run(in_a_handler)
    reconciler.forget("u-1")  # its last status forgotten: the same Warning is due again
    reconciler.run_all_as_kopf()
    assert posted and set(posted) == {"kopf's queue"}
