"""A small Kubernetes REST client over the `kubernetes` package's authenticated transport.

Objects stay plain dicts end to end (the manifest builders' output is sent as is), writes are
server-side apply under one field manager, and a 404 on read is None rather than an exception.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pagoda.operator.spec import GROUP, PLURAL, VERSION

FIELD_MANAGER = "pagoda-operator"

# (apiVersion, kind) -> plural, for every kind the operator writes or reads.
# Read only: Node, Pod (capacity, why pods wait). PVCs and Jobs: the model cache writes them. Secrets are
# never read: the pods reference them, and a missing one is in the pods' status (operator/pods.py).
READ_ONLY = ("Node", "Pod", "InferenceService", "Event")
PLURALS = {
    ("v1", "Service"): "services",
    ("v1", "Node"): "nodes",
    ("v1", "Pod"): "pods",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("batch/v1", "Job"): "jobs",
    ("apps/v1", "Deployment"): "deployments",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkersets",
    ("v1", "Event"): "events",  # read: LeaderWorkerSet's RecreateGroup (operator/groups.py)
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("networking.k8s.io/v1", "Ingress"): "ingresses",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproutes",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    (f"{GROUP}/{VERSION}", "InferenceService"): PLURAL,
}


class KubeError(Exception):
    def __init__(self, status: int, method: str, path: str, body: Any) -> None:
        message = body.get("message") if isinstance(body, dict) else str(body)
        super().__init__(f"{method} {path}: {status} {message}")
        self.message = str(message)
        self.status = status
        self.reason = body.get("reason", "") if isinstance(body, dict) else ""


def _error_body(data: bytes) -> Any:
    """An error's body: a Status object, or plain text (an API group the server does not serve answers
    404 with "404 page not found", not JSON)."""
    try:
        return json.loads(data) if data else None
    except ValueError:
        return data.decode(errors="replace").strip()


def object_path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = prefix + (f"/namespaces/{namespace}" if namespace else "") + f"/{PLURALS[(api_version, kind)]}"
    return path + (f"/{name}" if name else "")


class Kube:
    """The operator's API calls: get, apply, delete, list nodes, patch an InferenceService's status."""

    def __init__(self, api_client: Any) -> None:
        self._api = api_client

    @classmethod
    def from_environment(cls) -> Kube:
        """In-cluster credentials when running in a pod, else KUBECONFIG / ~/.kube/config."""
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(client.ApiClient())

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
        accept: str = "application/json",
    ) -> Any:
        headers = {"Accept": accept, "Content-Type": content_type}
        prepared = self._api.param_serialize(
            method,
            path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self._api.call_api(*prepared)
        data = response.read()
        if not 200 <= response.status <= 299:
            raise KubeError(response.status, method, path, _error_body(data))
        return json.loads(data) if data else None

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", object_path(api_version, kind, namespace, name))
        except KubeError as err:
            if err.status == 404:
                return None
            raise

    def apply(self, obj: Mapping[str, Any], dry_run: bool = False) -> dict[str, Any]:
        """Server-side apply; `force` takes back fields someone else changed (drift correction).

        With dry_run the API server validates and admits the object but stores nothing.
        """
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        if dry_run:
            query.append(("dryRun", "All"))
        return self.request("PATCH", path, body=obj, query=query, content_type="application/apply-patch+yaml")

    def replace(self, obj: Mapping[str, Any], dry_run: bool = False) -> dict[str, Any]:
        """PUT: the whole object as given (its resourceVersion guards against a concurrent change)."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        query = [("fieldManager", FIELD_MANAGER)]
        if dry_run:
            query.append(("dryRun", "All"))
        return self.request("PUT", path, body=obj, query=query)

    def delete(
        self, api_version: str, kind: str, namespace: str, name: str, propagation: str = "Background"
    ) -> None:
        """Foreground: the object goes only after its dependents (owner references) are gone."""
        try:
            body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation}
            self.request("DELETE", object_path(api_version, kind, namespace, name), body=body)
        except KubeError as err:
            if err.status != 404:
                raise

    def patch_metadata(
        self, api_version: str, kind: str, namespace: str, name: str, metadata: Mapping[str, Any]
    ) -> None:
        """A JSON merge patch of the metadata (a None value removes the field)."""
        path = object_path(api_version, kind, namespace, name)
        self.request("PATCH", path, body={"metadata": metadata}, content_type="application/merge-patch+json")

    def exists(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Only the metadata is fetched (PartialObjectMetadata)."""
        try:
            path = object_path(api_version, kind, namespace, name)
            self.request("GET", path, accept="application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1")
        except KubeError as err:
            if err.status == 404:
                return False
            raise
        return True

    def list_nodes(self) -> list[dict[str, Any]]:
        return self.request("GET", "/api/v1/nodes")["items"]

    def list_objects(
        self, api_version: str, kind: str, namespace: str, selector: str
    ) -> list[dict[str, Any]]:
        path = object_path(api_version, kind, namespace)
        return self.request("GET", path, query=[("labelSelector", selector)])["items"]

    def list_pods(self, namespace: str | None = None, selector: str = "") -> list[dict[str, Any]]:
        """Pods not yet finished, in one namespace or (None) all of them."""
        path = f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"
        query = [("fieldSelector", "status.phase!=Succeeded,status.phase!=Failed")]
        if selector:
            query.append(("labelSelector", selector))
        return self.request("GET", path, query=query)["items"]

    def list_events(self, namespace: str, kind: str, name: str, reason: str) -> list[dict[str, Any]]:
        """The events of one object with one reason (core/v1: events.k8s.io's are served there too)."""
        fields = f"involvedObject.kind={kind},involvedObject.name={name},reason={reason}"
        return self.request("GET", object_path("v1", "Event", namespace), query=[("fieldSelector", fields)])[
            "items"
        ]

    def get_inference_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get(f"{GROUP}/{VERSION}", "InferenceService", namespace, name)

    def list_inference_services(self, namespace: str | None = None) -> list[dict[str, Any]]:
        path = f"/apis/{GROUP}/{VERSION}" + (f"/namespaces/{namespace}" if namespace else "") + f"/{PLURAL}"
        return self.request("GET", path)["items"]

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        path = object_path(f"{GROUP}/{VERSION}", "InferenceService", namespace, name) + "/status"
        self.request("PATCH", path, body={"status": status}, content_type="application/merge-patch+json")
