"""The operator's own Prometheus metrics, and the HTTP endpoint that serves them (`--metrics-port`).

Counters and the histogram move as reconciles run. The per-InferenceService gauges are built at scrape
time from each object's last reconcile (dropped when it is deleted), so they stay right however often
one object is reconciled, and no label carries an object's name: every label value comes from a closed
set or from the cluster's GPU products. docs/metrics.md ("The operator") lists them;
tests/test_operator_metrics.py holds the two together.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, Literal, get_args

import urllib3
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagoda.operator.kube import KubeError
from pagoda.operator.profile import NO_FIT_CAUSES, NoFitCause
from pagoda.operator.reconcile import Result

ReconcileResult = Literal["ok", "invalid_spec", "apply_failed", "conflict", "error"]
ErrorKind = Literal["api", "connection", "internal"]
# Ready reasons that mean the reconcile could not do its work (status.py): everything else is "ok",
# however unready the pods are.
_FAILED = {"InvalidSpec": "invalid_spec", "ApplyFailed": "apply_failed", "Conflict": "conflict"}
# A reconcile reads ~6 objects and applies up to 6: tens of ms near the API server, seconds when it is slow.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _ready(result: Result) -> Mapping[str, Any]:
    return next((c for c in result.status.get("conditions") or () if c["type"] == "Ready"), {})


def result_of(result: Result) -> ReconcileResult:
    ready = _ready(result)
    return _FAILED.get(ready.get("reason", ""), "ok")  # type: ignore[return-value]


def error_kind(err: BaseException) -> ErrorKind:
    if isinstance(err, KubeError):
        return "api"  # the API server answered with an error status
    if isinstance(err, urllib3.exceptions.HTTPError | OSError):
        return "connection"  # no answer: refused, reset, timed out
    return "internal"


@dataclasses.dataclass(frozen=True)
class ServiceState:
    """What the gauges count of one InferenceService, from its last reconcile."""

    ready: str  # the Ready condition's status: "True" or "False"
    ready_reason: str
    profile: tuple[str, str, str] | None  # (gpu_product, precision, tensor_parallel) of status.profile
    no_fit: NoFitCause | None  # why no GPU fits, if none does (the workload may still run: kept)

    @classmethod
    def of(cls, result: Result) -> ServiceState:
        ready = _ready(result)
        profile = result.status.get("profile") or {}
        gpu = profile.get("gpu") or {}
        decision = result.decision
        return cls(
            ready=ready.get("status", "Unknown"),
            ready_reason=ready.get("reason", ""),
            # A kept workload shows the profile it runs (reconcile merges it into status.profile).
            profile=(gpu["product"], str(profile.get("precision")), str(profile.get("tensorParallelSize")))
            if gpu.get("product")
            else None,
            no_fit=decision.cause if decision is not None and not decision.is_selected else None,
        )


@dataclasses.dataclass
class Outcome:
    """Filled in by the reconcile that OperatorMetrics.reconcile() measures."""

    result: Result | None = None
    is_gone: bool = False  # the object was deleted meanwhile: count the reconcile, keep no state


class OperatorMetrics:
    """The operator's metrics on one registry (a fresh one per test; the CLI's is served)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.reconciles = Counter(
            "pagoda_operator_reconciles",
            "InferenceService reconciles, by result",
            ["result"],
            registry=registry,
        )
        self.duration = Histogram(
            "pagoda_operator_reconcile_duration_seconds",
            "Time of one reconcile: read, select, apply, write the status and events",
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.errors = Counter(
            "pagoda_operator_reconcile_errors",
            "Reconciles that raised (retried by kopf), by kind of error",
            ["error"],
            registry=registry,
        )
        for result in get_args(ReconcileResult):
            self.reconciles.labels(result)
        for kind in get_args(ErrorKind):
            self.errors.labels(kind)
        self._services: dict[str, ServiceState] = {}
        self._guard = threading.Lock()
        registry.register(_ServiceGauges(self))

    @contextlib.contextmanager
    def reconcile(self, uid: str) -> Iterator[Outcome]:
        """Time the block, count its result (or its exception, re-raised) and keep the object's state."""
        outcome = Outcome()
        started = time.perf_counter()
        try:
            yield outcome
        except Exception as err:
            self.errors.labels(error_kind(err)).inc()
            self.reconciles.labels("error").inc()
            raise
        finally:
            self.duration.observe(time.perf_counter() - started)
        if outcome.result is None:
            return
        self.reconciles.labels(result_of(outcome.result)).inc()
        with self._guard:
            if outcome.is_gone:
                self._services.pop(uid, None)
            else:
                self._services[uid] = ServiceState.of(outcome.result)

    def forget(self, uid: str) -> None:
        with self._guard:
            self._services.pop(uid, None)

    def services(self) -> list[ServiceState]:
        with self._guard:
            return list(self._services.values())


class _ServiceGauges(Collector):
    def __init__(self, metrics: OperatorMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        states = self._metrics.services()
        profiles = GaugeMetricFamily(
            "pagoda_operator_profile_services",
            "InferenceServices by the profile in their status (selected, or kept running)",
            labels=["gpu_product", "precision", "tensor_parallel"],
        )
        for key, count in sorted(collections.Counter(s.profile for s in states if s.profile).items()):
            profiles.add_metric(list(key), count)
        no_fit = GaugeMetricFamily(
            "pagoda_operator_no_fitting_gpu_services",
            "InferenceServices for which no GPU fits now, by why",
            labels=["reason"],
        )
        causes = collections.Counter(s.no_fit for s in states)
        for cause in NO_FIT_CAUSES:
            no_fit.add_metric([cause], causes[cause])  # type: ignore[index]
        ready = GaugeMetricFamily(
            "pagoda_operator_inference_services",
            "InferenceServices by their Ready condition's status and reason",
            labels=["ready", "reason"],
        )
        for (status, reason), count in sorted(
            collections.Counter((s.ready, s.ready_reason) for s in states).items()
        ):
            ready.add_metric([status, reason], count)
        yield from (profiles, no_fit, ready)


def new_registry() -> CollectorRegistry:
    """A registry with the process, platform and GC series prometheus_client's default one has."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def serve(registry: CollectorRegistry, port: int, address: str = "0.0.0.0") -> int:
    """Serve the registry at http://address:port/metrics in a daemon thread; returns the bound port.
    `MetricsPortError` when the port cannot be bound (taken, or not allowed)."""
    try:
        server, _ = start_http_server(port, address, registry)
    except OSError as exc:
        raise MetricsPortError(f"cannot serve metrics on {address}:{port}: {exc.strerror or exc}") from exc
    return int(server.server_port)


class MetricsPortError(Exception):
    pass
