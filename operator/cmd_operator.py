"""`pagoda operator`: run the InferenceService operator (kopf) against the current cluster.

Credentials: in a pod, its ServiceAccount; elsewhere KUBECONFIG or ~/.kube/config. Every flag also
reads PAGODA_OPERATOR_<FLAG> from the environment (the chart sets them), a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable

from pagoda.operator.spec import OperatorConfig

HELP = "Run the InferenceService operator: GPU-aware profile selection, rollout and status."

_DEFAULTS = OperatorConfig()


def _env(name: str, default: object) -> object:
    return os.environ.get("PAGODA_OPERATOR_" + name.upper().replace("-", "_"), default)


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{value}: expected 0 (off) or a port number up to 65535")
    return port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    def flag(name: str, help: str, default: object, type: Callable[[str], object] = str) -> None:
        parser.add_argument(f"--{name}", type=type, default=_env(name, default), help=help)

    flag("server-image", "Server image for InferenceServices that name none", _DEFAULTS.server_image)
    flag(
        "downloader-image",
        "Image running `pagoda download` for uncached hf:// models (empty: the server image)",
        _DEFAULTS.downloader_image,
    )
    flag("kernel-cache-pvc", "ReadWriteMany claim for Triton kernels (subPath per GPU arch)", "")
    flag("resync-seconds", "Periodic re-check of each object (nodes, drift)", _DEFAULTS.resync_seconds, float)
    flag(
        "startup-timeout",
        "Seconds a model load may take (startup probe)",
        _DEFAULTS.startup_timeout_seconds,
        int,
    )
    flag("drain-seconds", "Seconds in-flight requests get after SIGTERM", _DEFAULTS.drain_seconds, int)
    flag("cluster-domain", "Cluster DNS domain for status URLs", _DEFAULTS.cluster_domain)
    parser.add_argument(
        "--namespace",
        action="append",
        default=[n for n in str(_env("namespace", "")).split(",") if n],
        help="Namespace to serve (repeatable); default: all namespaces",
    )
    flag("liveness", "kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz", "")
    flag("metrics-port", "Serve Prometheus metrics at http://0.0.0.0:PORT/metrics (0: off)", 0, _port)
    flag("log-level", "Logging level", "info")


def build_config(args: argparse.Namespace) -> OperatorConfig:
    return OperatorConfig(
        server_image=args.server_image,
        downloader_image=args.downloader_image,
        kernel_cache_pvc=args.kernel_cache_pvc or None,
        resync_seconds=args.resync_seconds,
        startup_timeout_seconds=args.startup_timeout,
        drain_seconds=args.drain_seconds,
        cluster_domain=args.cluster_domain,
    )


def run(args: argparse.Namespace) -> int:
    import kopf

    from pagoda.operator import metrics
    from pagoda.operator.handlers import Reconciler, configure, register
    from pagoda.operator.kube import Kube

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("pagoda.operator")
    config = build_config(args)
    metrics_registry = metrics.new_registry()
    reconciler = Reconciler(Kube.from_environment(), config, metrics.OperatorMetrics(metrics_registry))
    if args.metrics_port:
        try:
            port = metrics.serve(metrics_registry, args.metrics_port)
        except metrics.MetricsPortError as exc:
            log.error("%s (--metrics-port / PAGODA_OPERATOR_METRICS_PORT)", exc)
            return 2
        log.info("metrics at http://0.0.0.0:%d/metrics", port)
    registry = kopf.OperatorRegistry()
    register(registry, reconciler, tuple(args.namespace))
    settings = kopf.OperatorSettings()
    configure(settings)
    log.info("starting with %s", config)
    kopf.run(
        registry=registry,
        settings=settings,
        standalone=True,  # one replica (Recreate strategy): no peering objects, no peering permissions
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
    )
    return 0
