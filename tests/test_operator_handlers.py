"""The kopf wiring: every trigger is registered, settings keep kopf's bookkeeping under our group."""

from __future__ import annotations

import kopf

from pagoda.operator.handlers import Reconciler, configure, register
from pagoda.operator.spec import OperatorConfig


def test_handlers_are_registered() -> None:
    registry = kopf.OperatorRegistry()
    register(registry, Reconciler(kube=None, config=OperatorConfig(resync_seconds=7)))  # type: ignore[arg-type]
    changing = {h.id: h for h in registry._changing.get_all_handlers()}
    assert {"reconcile-create", "reconcile-update", "reconcile-resume", "forget"} <= set(changing)
    assert changing["forget"].requires_finalizer is False  # garbage collection cleans up, not a handler
    timers = {h.id: h for h in registry._spawning.get_all_handlers()}
    assert timers["resync"].interval == 7
    watching = {h.id for h in registry._watching.get_all_handlers()}
    assert {f"child-{p}" for p in ("services", "deployments", "horizontalpodautoscalers")} <= watching
    assert "server-pods" in watching


def test_settings() -> None:
    settings = kopf.OperatorSettings()
    configure(settings)
    assert settings.persistence.finalizer == "serving.pagoda.dev/finalizer"
    assert settings.scanning.disabled is True
