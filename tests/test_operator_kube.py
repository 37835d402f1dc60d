"""operator/kube.py's `Kube` against a stand-in API server over HTTP (the e2e suite runs it against the
real one): what its error answers become, whatever their body."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest
from kubernetes import client

from pagoda.operator.kube import Kube, KubeError

SERVICE = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "llm", "namespace": "ns"}}


class _Handler(http.server.BaseHTTPRequestHandler):
    """As kube-apiserver answers: JSON for known paths and Status errors; plain text for an API group
    it does not serve (no CRD installed)."""

    def do_GET(self) -> None:
        if self.path.startswith("/apis/gateway.networking.k8s.io/"):
            self._send(404, b"404 page not found\n", "text/plain; charset=utf-8")
        elif self.path == "/api/v1/namespaces/ns/services/llm":
            self._send(200, json.dumps(SERVICE).encode(), "application/json")
        elif self.path == "/api/v1/namespaces/ns/services/forbidden":
            status = {
                "kind": "Status",
                "message": "services is forbidden",
                "reason": "Forbidden",
                "code": 403,
            }
            self._send(403, json.dumps(status).encode(), "application/json")
        else:
            status = {"kind": "Status", "message": "not found", "reason": "NotFound", "code": 404}
            self._send(404, json.dumps(status).encode(), "application/json")

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def kube() -> Iterator[Kube]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = client.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}")
    try:
        yield Kube(client.ApiClient(config))
    finally:
        server.shutdown()


def test_an_object_is_read_and_a_missing_one_is_none(kube: Kube) -> None:
    assert kube.get("v1", "Service", "ns", "llm") == SERVICE
    assert kube.get("v1", "Service", "ns", "gone") is None


def test_an_api_group_the_server_does_not_serve_is_a_404_not_a_crash(kube: Kube) -> None:
    """A cluster without the Gateway API: every reconcile reads the HTTPRoute slot."""
    assert kube.get("gateway.networking.k8s.io/v1", "HTTPRoute", "ns", "llm") is None
    with pytest.raises(KubeError) as err:
        kube.request("GET", "/apis/gateway.networking.k8s.io/v1/namespaces/ns/httproutes")
    assert (err.value.status, err.value.message) == (404, "404 page not found")


def test_a_status_error_keeps_its_message_and_reason(kube: Kube) -> None:
    with pytest.raises(KubeError) as err:
        kube.get("v1", "Service", "ns", "forbidden")
    assert (err.value.status, err.value.reason, err.value.message) == (
        403,
        "Forbidden",
        "services is forbidden",
    )
