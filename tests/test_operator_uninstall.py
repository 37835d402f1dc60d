"""`pagoda uninstall` (the chart's pre-delete hook) against an in-memory stand-in for the API server;
e2e/test_real_pods.py runs it as the hook of a real `helm uninstall`."""

from __future__ import annotations

import io

from pagoda.operator.cmd_uninstall import CACHE_SELECTOR, uninstall


class Cluster:
    """InferenceServices that go a given number of looks after their deletion (the garbage collector's
    foreground deletion of their children), and cache PVCs with owners."""

    def __init__(self, services: dict[str, list[str]], looks_to_go: int = 2) -> None:
        self.services = services  # namespace -> names
        self.deleted: list[tuple[str, str, str]] = []
        self.patched: list[tuple[str, str, dict]] = []
        self.looks_to_go = looks_to_go
        self.pvcs = {ns: [f"{name}-model" for name in names] for ns, names in services.items()}

    def list_inference_services(self, namespace: str | None = None) -> list[dict]:
        if self.deleted:
            self.looks_to_go -= 1
            if self.looks_to_go <= 0:
                for ns, name, _ in self.deleted:
                    if name in self.services.get(ns, []):
                        self.services[ns].remove(name)
        return [
            {"metadata": {"namespace": ns, "name": name}}
            for ns, names in self.services.items()
            if namespace in (None, ns)
            for name in names
        ]

    def delete(self, api_version: str, kind: str, namespace: str, name: str, propagation: str) -> None:
        assert (api_version, kind) == ("serving.pagoda.dev/v1alpha1", "InferenceService")
        self.deleted.append((namespace, name, propagation))

    def list_objects(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict]:
        assert (kind, selector) == ("PersistentVolumeClaim", CACHE_SELECTOR)
        return [{"metadata": {"name": name}} for name in self.pvcs.get(namespace, [])]

    def patch_metadata(self, api_version: str, kind: str, namespace: str, name: str, metadata: dict) -> None:
        self.patched.append((namespace, name, metadata))


def test_every_service_is_deleted_in_the_foreground_and_waited_for() -> None:
    cluster, out, naps = Cluster({"a": ["x", "y"], "b": ["z"]}), io.StringIO(), []
    assert uninstall(cluster, out=out, sleep=naps.append) == 0  # type: ignore[arg-type]
    assert cluster.deleted == [("a", "x", "Foreground"), ("a", "y", "Foreground"), ("b", "z", "Foreground")]
    assert naps == [1.0]  # looked again until they were gone
    assert cluster.patched == []  # the cache goes with its owner
    assert out.getvalue().splitlines()[-1] == "every InferenceService and its children are gone"


def test_only_the_namespaces_served() -> None:
    cluster = Cluster({"a": ["x"], "b": ["z"]})
    assert uninstall(cluster, ("b",), out=io.StringIO(), sleep=lambda _: None) == 0  # type: ignore[arg-type]
    assert cluster.deleted == [("b", "z", "Foreground")] and cluster.services["a"] == ["x"]


def test_refuse_deletes_nothing_and_names_what_is_left() -> None:
    cluster, out = Cluster({"a": ["x"], "b": ["z"]}), io.StringIO()
    assert uninstall(cluster, refuse=True, out=out) == 1  # type: ignore[arg-type]
    assert cluster.deleted == []
    assert out.getvalue().startswith("2 InferenceService(s) left: a/x, b/z. Delete them first")
    empty = Cluster({})
    assert uninstall(empty, refuse=True, out=io.StringIO()) == 0  # type: ignore[arg-type]


def test_the_model_cache_is_orphaned_first_when_kept() -> None:
    cluster = Cluster({"a": ["x"]})
    assert uninstall(cluster, keep_model_cache=True, out=io.StringIO(), sleep=lambda _: None) == 0  # type: ignore[arg-type]
    assert cluster.patched == [("a", "x-model", {"ownerReferences": None})]


def test_a_deletion_that_never_ends_fails_after_the_timeout() -> None:
    cluster, out = Cluster({"a": ["x"]}, looks_to_go=10**9), io.StringIO()
    assert uninstall(cluster, timeout=0.0, out=out, sleep=lambda _: None) == 1  # type: ignore[arg-type]
    assert out.getvalue().splitlines()[-1] == "still there after 0 s: a/x"
