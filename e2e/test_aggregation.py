"""The aggregation layer end to end: an extension API server on the host, registered through an
APIService whose Service is `type: ExternalName` → localhost (there is no kube-proxy), is reached by
kube-apiserver with the front-proxy client certificate and the requestheader identity headers. This
is the path a metrics adapter (and so the HPA on custom/external metrics) takes."""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

GROUP = "aggregation-test.pagoda.local"
VERSION = "v1"


class _Handler(BaseHTTPRequestHandler):
    seen: list[dict[str, str]]

    def do_GET(self) -> None:
        peer = self.connection.getpeercert() or {}
        subject = dict(x[0] for x in peer.get("subject", ()))
        self.seen.append({"path": self.path, "user": self.headers.get("X-Remote-User", ""), **subject})
        if self.path.split("?")[0] == f"/apis/{GROUP}/{VERSION}":
            ping = {"name": "pings", "namespaced": True, "kind": "Ping", "verbs": ["get"]}
            body = {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": f"{GROUP}/{VERSION}",
                    "resources": [ping]}  # fmt: skip
            self._reply(200, body)
        else:
            self._reply(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404})

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def extension_server(cluster) -> Iterator[tuple[int, list[dict[str, str]]]]:
    if cluster.workdir is None:
        pytest.skip("needs the local cluster's front-proxy CA (PAGODA_E2E_KUBECONFIG is set)")
    pki = cluster.workdir / "pki"
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki / "apiserver.crt", pki / "apiserver.key")  # any serving cert will do
    ctx.load_verify_locations(pki / "front-proxy-ca.crt")
    ctx.verify_mode = ssl.CERT_REQUIRED  # only the aggregator's front-proxy client gets in
    seen: list[dict[str, str]] = []
    handler = type("Handler", (_Handler,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler, bind_and_activate=False)
    server.socket = ctx.wrap_socket(socket.socket(), server_side=True)
    server.server_bind()
    server.server_activate()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


def test_apiservice_via_externalname_reaches_a_host_process(cluster, namespace, extension_server):
    port, seen = extension_server
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "ext", "namespace": namespace},
               "spec": {"type": "ExternalName", "externalName": "localhost"}}  # fmt: skip
    apiservice = {
        "apiVersion": "apiregistration.k8s.io/v1",
        "kind": "APIService",
        "metadata": {"name": f"{VERSION}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "version": VERSION,
            "groupPriorityMinimum": 100,
            "versionPriority": 100,
            "insecureSkipTLSVerify": True,  # the aggregator would verify ext.<ns>.svc, not localhost
            "service": {"name": "ext", "namespace": namespace, "port": port},
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                          "items": [service, apiservice]}))  # fmt: skip
    try:
        cluster.kubectl("wait", f"apiservice/{VERSION}.{GROUP}", "--for=condition=Available", "--timeout=60s")
        deadline = time.monotonic() + 30
        while True:
            got = cluster.kubectl("get", "--raw", f"/apis/{GROUP}/{VERSION}", check=False)
            if got.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["resources"][0]["name"] == "pings"
        proxied = [s for s in seen if s["user"]]
        assert proxied, seen
        assert proxied[-1]["commonName"] == "front-proxy-client"
        assert proxied[-1]["user"] == "pagoda-e2e-admin"  # the requestheader identity of the caller
    finally:
        cluster.kubectl("delete", "apiservice", f"{VERSION}.{GROUP}", "--wait=false", check=False)
