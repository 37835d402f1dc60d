"""Fixtures of the e2e suite: a real Kubernetes control plane with simulated GPU nodes.

- `cluster` (session): one cluster per test run. Attributes: `.kubeconfig` (Path), `.bin_dir` (Path,
  holds kubectl, helm, ...), `.env` (environment for subprocesses: KUBECONFIG, PATH with bin_dir first),
  `.kubectl(*args, input=None, check=True)` (a CompletedProcess, text, output captured), `.workdir`
  (None for an existing cluster).
- `namespace` (function): a fresh namespace name, deleted afterwards (its pods are waited for).
- `kubeconfig` (session): the cluster's kubeconfig path.
- `gpu_catalogue`: e2e/gpu_nodes.yaml as loaded data; `cluster_harness`: the launcher module.
- `real_node` (session): this machine joined to `cluster` as a real node running containers
  (harness/realnode.py); skips with the reason when the machine cannot run containers.
- `metrics_pipeline` (session): Prometheus and prometheus-adapter serving custom.metrics.k8s.io to the
  real HPA controller, with the chart's PodMonitor, recording rule and adapter rules
  (harness/metrics.py); needs the real node (its pods are what it scrapes).
- `lws` (session): LeaderWorkerSet's CRD, controller and webhooks, and cluster DNS (CoreDNS), for the
  tests of models over several pods (harness/lws.py); needs the real node.
- `real_images` (session): {"server": ref, "operator": ref}, docker/*.Dockerfile built (when their
  inputs changed) and imported into the real node (harness/images.py); the build goes to the log.

By default the cluster is built and started here (e2e/harness/cluster.py; binaries from
e2e/tools/build.sh). PAGODA_E2E_KUBECONFIG=<path> uses an existing cluster instead (kind, see
e2e/kind/): kubectl and helm are then taken from PAGODA_K8S_BIN or PATH.
PAGODA_E2E_KEEP=1 leaves the work directory (logs, etcd data) of the local cluster behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from by_path import load_by_path

E2E = Path(__file__).resolve().parent


# pytest runs with --import-mode=importlib and e2e/ is not a package: import the launcher by path.
harness = load_by_path("pagoda_e2e_harness_cluster", E2E / "harness" / "cluster.py")


def _reap_stale_clusters() -> None:
    """Stops clusters of earlier test runs whose pytest process is gone (killed before teardown)."""
    for workdir in Path(tempfile.gettempdir()).glob("pagoda-e2e-*"):
        try:
            owner = int((workdir / "owner.pid").read_text())
        except (OSError, ValueError):
            continue
        if not Path(f"/proc/{owner}").exists():
            harness.stop(workdir)
            shutil.rmtree(workdir, ignore_errors=True)


def _existing_cluster(kubeconfig: str) -> object:
    bin_dir = os.environ.get("PAGODA_K8S_BIN")
    if not bin_dir:
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            pytest.fail("PAGODA_E2E_KUBECONFIG is set but no kubectl on PATH (or set PAGODA_K8S_BIN)")
        bin_dir = str(Path(kubectl).parent)
    return harness.Cluster(kubeconfig=Path(kubeconfig).resolve(), bin_dir=Path(bin_dir))


@pytest.fixture(scope="session")
def cluster() -> Iterator[object]:
    existing = os.environ.get("PAGODA_E2E_KUBECONFIG")
    if existing:
        ours = _existing_cluster(existing)
        try:
            yield ours
        finally:
            ours.remove_scratch()  # type: ignore[attr-defined]
        return
    _reap_stale_clusters()
    bin_dir = harness.ensure_binaries()
    workdir = Path(tempfile.mkdtemp(prefix="pagoda-e2e-"))
    try:
        yield harness.start(workdir, bin_dir, attached=True)
    finally:
        harness.stop(workdir)
        if not os.environ.get("PAGODA_E2E_KEEP"):
            shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def kubeconfig(cluster) -> Path:
    return cluster.kubeconfig


@pytest.fixture
def namespace(cluster) -> Iterator[str]:
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        _delete_namespace(cluster, name)


def _delete_namespace(cluster, name: str, timeout: float = 60.0) -> None:
    """Deletes the namespace and waits until its pods are gone, so that they no longer hold simulated
    GPUs when the next test starts. A terminating namespace admits no new pods, so its pods can be
    removed at once instead of waiting for the namespace controller's next pass (about 5 s); the
    namespace object itself finishes in the background."""
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
    cluster.kubectl("delete", "pods", "--all", "-n", name, "--grace-period=0", "--force", "--wait=false",
                    check=False)  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = cluster.kubectl("get", "pods", "-n", name, "-o", "name", check=False)
        if left.returncode == 0 and not left.stdout.strip():
            return
        time.sleep(0.2)
    pytest.fail(f"pods of namespace {name} still there {timeout:.0f}s after deleting it")


@pytest.fixture(scope="session")
def gpu_catalogue() -> dict:
    return harness.nodes.load_catalogue()


@pytest.fixture(scope="session")
def cluster_harness() -> ModuleType:
    """The launcher module (e2e/harness/cluster.py): `start(workdir, bin_dir)`, `stop(workdir)`, ..."""
    return harness


@pytest.fixture(scope="session")
def real_node(cluster) -> object:
    """This machine as a real node of `cluster` (started on first use, stopped with the cluster)."""
    try:
        return harness.start_real_node(cluster, attached=True)
    except harness.realnode.Unavailable as e:
        pytest.skip(f"no real node on this machine: {e}")


@pytest.fixture(scope="session")
def lws(cluster, real_node) -> object:
    """LeaderWorkerSet (CRD, controller, webhooks) and cluster DNS for `cluster` (harness/lws.py; started
    on first use, stopped with the cluster): `.webhook_url`, `.dns`, `.tail()` of the controller's log."""
    return harness.start_lws(cluster, attached=True)


@pytest.fixture(scope="session")
def real_images(cluster, real_node, request) -> dict[str, str]:
    """The server and operator images in the real node's containerd, built when their inputs changed.
    The build's output goes to the terminal (the test log), not to pytest's capture."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        try:
            return harness.build_images(cluster, real_node)
        except harness.images.NoRoom as e:
            pytest.skip(str(e))


@pytest.fixture(scope="session")
def metrics_pipeline(cluster, real_node) -> object:
    """Prometheus + prometheus-adapter for `cluster` (started on first use, stopped with the cluster)."""
    return harness.start_metrics(cluster, attached=True)
