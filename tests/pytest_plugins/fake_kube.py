"""FakeKube: an in-memory test double of operator/kube.py's `Kube`, for the operator's unit tests.

It stands in for the calls reconcile() and handlers.Reconciler make: `get`, `apply` (dry run too),
`delete`, `exists`, `list_nodes`, `list_pods`, `list_objects`, `list_events` and `patch_status`. A fake
is enough here because these tests check reconcile logic (which children, which status, which events), not the
API server; e2e/test_operator.py runs the real `Kube` against a real one. On sys.path through
pyproject's `pythonpath` (not a plugin: nothing registers it).
"""

from __future__ import annotations

import copy

from pagoda.operator.kube import KubeError


class FakeKube:
    """Objects in a dict keyed (kind, namespace, name); every read and write hands out a deep copy.

    What a test sets up: `nodes`, `pods` (listed by `list_pods` and `list_objects("Pod")`), `present`
    (the (kind, name) of the PVCs that `exists`), `refuse` (the API server's answer to an
    apply of a kind, dry run or not) and `fail` (a method name -> what every call of it raises).
    What it records: `writes` ("apply Kind" when a spec changes, "delete Kind") and `statuses`
    (name -> the last status patched).
    """

    def __init__(self, nodes: list[dict]) -> None:
        self.nodes = nodes
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.pods: list[dict] = []
        self.events: list[dict] = []  # listed by list_events, filtered as the field selector does
        self.present: set[tuple[str, str]] = set()
        self.refuse: dict[tuple[str, bool], KubeError] = {}
        self.fail: dict[str, Exception] = {}
        self.writes: list[str] = []
        self.statuses: dict[str, dict] = {}

    def _call(self, method: str) -> None:
        if method in self.fail:
            raise self.fail[method]

    def list_nodes(self) -> list[dict]:
        self._call("list_nodes")
        return copy.deepcopy(self.nodes)

    def list_pods(self, namespace: str | None = None, selector: str = "") -> list[dict]:
        """Every pod in `pods`: the tests put there only the pods the call should see."""
        self._call("list_pods")
        return copy.deepcopy(self.pods)

    def list_objects(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict]:
        self._call("list_objects")
        wanted = dict(s.split("=", 1) for s in selector.split(","))
        return [
            copy.deepcopy(o)
            for (k, ns, _), o in self.objects.items()
            if k == kind and ns == namespace and wanted.items() <= (o["metadata"].get("labels") or {}).items()
        ] + [
            copy.deepcopy(p)
            for p in self.pods
            if kind == "Pod" and wanted.items() <= p["metadata"].get("labels", {}).items()
        ]

    def list_events(self, namespace: str, kind: str, name: str, reason: str) -> list[dict]:
        self._call("list_events")
        return [
            copy.deepcopy(e)
            for e in self.events
            if (e["involvedObject"]["kind"], e["involvedObject"]["name"], e["reason"]) == (kind, name, reason)
        ]

    def exists(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        self._call("exists")
        return (kind, name) in self.present

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        self._call("get")
        return copy.deepcopy(self.objects.get((kind, namespace, name)))

    def apply(self, obj: dict, dry_run: bool = False) -> dict:
        """Like server-side apply: the generation moves only when the spec does; status is kept."""
        self._call("apply")
        if (error := self.refuse.get((obj["kind"], dry_run))) is not None:
            raise error
        self._check_role_binding(obj)
        if dry_run:
            return copy.deepcopy(obj)
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        before = self.objects.get(key)
        stored = copy.deepcopy(obj)
        generation = (before or {}).get("metadata", {}).get("generation", 0)
        if before is None or before.get("spec") != obj.get("spec"):
            generation += 1
            self.writes.append(f"apply {obj['kind']}")
        stored["metadata"]["generation"] = generation
        if before is not None and "status" in before:
            stored["status"] = before["status"]
        self.objects[key] = stored
        return copy.deepcopy(stored)

    def _check_role_binding(self, obj: dict) -> None:
        """RBAC's escalation check, as the API server makes it for a caller that may not bind any role:
        a RoleBinding's Role must exist (its rules are compared with the caller's), dry run or not."""
        if obj["kind"] != "RoleBinding" or obj["roleRef"]["kind"] != "Role":
            return
        namespace, role = obj["metadata"]["namespace"], obj["roleRef"]["name"]
        if ("Role", namespace, role) not in self.objects:
            raise KubeError(404, "PATCH", "/rolebindings", {"message": f'roles "{role}" not found'})

    def replace(self, obj: dict, dry_run: bool = False) -> dict:
        """A PUT: the object as given replaces the stored one (no managedFields kept)."""
        self._call("replace")
        if dry_run:
            return copy.deepcopy(obj)
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.writes.append(f"replace {obj['kind']}")
        self.objects[key] = copy.deepcopy(obj)
        return copy.deepcopy(obj)

    def delete(
        self, api_version: str, kind: str, namespace: str, name: str, propagation: str = "Background"
    ) -> None:
        self._call("delete")
        self.writes.append(f"delete {kind}")
        self.objects.pop((kind, namespace, name), None)

    def patch_status(self, namespace: str, name: str, status: dict) -> None:
        self._call("patch_status")
        self.statuses[name] = status
