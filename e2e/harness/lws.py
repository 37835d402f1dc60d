"""LeaderWorkerSet and cluster DNS for the e2e cluster, started when a test first needs them.

- **LeaderWorkerSet** (sigs.k8s.io/lws, built by tools/build-lws.sh): its CRD as the module ships it, and
  its controller manager as a host process. LWS cannot run without its webhooks: the pod webhook gives
  every pod of a group its labels (group and worker index) and LWS_LEADER_ADDRESS / LWS_WORKER_INDEX /
  LWS_GROUP_SIZE, and the LeaderWorkerSet webhook defaults and validates the object. So the manager serves
  them on 127.0.0.1 with a certificate made here (its own certificate rotation wants an in-cluster Service),
  and its webhook configurations, as the module ships them, point at that URL with our CA: kube-apiserver
  runs on this machine and reaches it directly. The pod webhooks keep LWS's own object selector (only
  pods of a LeaderWorkerSet), so nothing else depends on this process. It talks to the API as the
  cluster's admin (a host process of the test cluster, as kube-controller-manager is), with no leader
  election.
- **CoreDNS** (the same script): a group's workers reach their leader by name (LWS_LEADER_ADDRESS,
  `<group>.<lws>.<namespace>`, from the headless Service LWS makes), so the cluster needs DNS. CoreDNS
  with its kubernetes plugin serves `cluster.local` on the real node's address, where the kubelet points
  every pod (realnode.py, clusterDNS); until it runs, a pod's lookup is refused at once, not timed out.

Every process names the cluster's work directory, so the cluster's teardown stops them.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
import subprocess
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE.parent / "tools" / "build-lws.sh"
POD_SELECTOR = {"matchExpressions": [{"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]}
CLUSTER_DOMAIN = "cluster.local"


def ensure_binaries() -> Path:
    """Runs build-lws.sh (a no-op once cached) and returns its cache directory (bin/, manifests/)."""
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} failed (exit {proc.returncode}); its log is above")
    return Path(proc.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class Lws:
    webhook_url: str
    dns: str  # host:port of the cluster DNS
    log: Path

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def webhook_configurations(manifests: str, url: str, ca_bundle: bytes) -> list[dict[str, Any]]:
    """LWS's webhook configurations (config/webhook/manifests.yaml) pointed at `url` (its Service is not
    there): the LeaderWorkerSet and pod webhooks, the pod ones only for pods of a LeaderWorkerSet (as its
    kustomize patch has them); DisaggregatedSet's left out (no CRD for it here)."""
    out = []
    for doc in yaml.safe_load_all(manifests):
        if not doc:
            continue
        hooks = []
        for hook in doc["webhooks"]:
            if "disaggregatedset" in hook["name"]:
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": url + path, "caBundle": base64.b64encode(ca_bundle).decode()}
            if any("pods" in rule["resources"] for rule in hook["rules"]):
                hook["objectSelector"] = POD_SELECTOR
            hooks.append(hook)
        doc["metadata"] = {"name": f"lws-{doc['metadata']['name']}"}
        doc["webhooks"] = hooks
        out.append(doc)
    return out


def _serving_cert(pki: Any, d: Path) -> None:
    """A CA of its own and a serving certificate for 127.0.0.1, as tls.crt / tls.key (controller-runtime's
    names) in `d`."""
    d.mkdir(parents=True, exist_ok=True)
    pki._ca(d, "ca", "pagoda-e2e-lws-webhook-ca")
    pki._leaf(d, "tls", "ca", "/CN=lws-webhook", "serverAuth", ("IP:127.0.0.1",))


def dns_query(server: tuple[str, int], name: str, timeout: float = 2.0) -> list[str]:
    """The A records `server` gives for `name` (a hand-made query: no resolver library on the host)."""
    query = struct.pack(">HHHHHH", 0x5A5A, 0x0100, 1, 0, 0, 0)
    query += b"".join(bytes([len(p)]) + p.encode() for p in name.rstrip(".").split(".")) + b"\0"
    query += struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.sendto(query, server)
        answer = sock.recv(4096)
    count, offset = struct.unpack(">H", answer[6:8])[0], len(query)
    addresses = []
    for _ in range(count):
        offset += 2 if answer[offset] & 0xC0 == 0xC0 else answer.index(b"\0", offset) + 1 - offset
        kind, _, _, length = struct.unpack(">HHIH", answer[offset : offset + 10])
        offset += 10
        if kind == 1 and length == 4:
            addresses.append(socket.inet_ntoa(answer[offset : offset + 4]))
        offset += length
    return addresses


def start(
    cluster: Any,
    pki: Any,
    node_ip: str,
    spawn: Callable[[str, list[str]], subprocess.Popen],
    wait: Callable[[str, Callable[[], bool], dict[str, subprocess.Popen]], None],
    free_ports: Callable[[int], list[int]],
) -> Lws:
    cache = ensure_binaries()
    workdir = cluster.workdir / "lws"
    certs = workdir / "certs"
    _serving_cert(pki, certs)
    webhook_port, health_port = free_ports(2)
    # LWS's manager also runs a DisaggregatedSet controller, and exits when that CRD is missing.
    for crd in ("crd.yaml", "disaggregatedset-crd.yaml"):
        cluster.kubectl("apply", "--server-side", "-f", str(cache / "manifests" / crd))

    def established() -> bool:  # `kubectl wait` fails on a CRD with no conditions yet
        names = ("leaderworkersets.leaderworkerset.x-k8s.io", "disaggregatedsets.disaggregatedset.x-k8s.io")
        got = json.loads(cluster.kubectl("get", "crd", *names, "-o", "json").stdout)["items"]
        return len(got) == 2 and all(
            any(
                c["type"] == "Established" and c["status"] == "True"
                for c in crd["status"]["conditions"] or ()
            )
            for crd in got
        )

    wait("the LeaderWorkerSet CRDs Established", established, {})
    config = {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(certs)},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
    }
    (workdir / "config.yaml").write_text(json.dumps(config))
    controller = spawn(
        "lws",
        [str(cache / "bin" / "lws-controller"), f"--config={workdir / 'config.yaml'}",
         f"--kubeconfig={cluster.kubeconfig}", "--zap-log-level=info"],
    )  # fmt: skip
    url = f"https://127.0.0.1:{webhook_port}"

    def serving() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/readyz", timeout=2) as r:
                ready = r.status == 200
            with socket.create_connection(("127.0.0.1", webhook_port), timeout=2):
                return ready
        except OSError:
            return False

    wait("the LeaderWorkerSet controller and its webhooks", serving, {"lws": controller})
    manifests = (cache / "manifests" / "webhooks.yaml").read_text()
    for doc in webhook_configurations(manifests, url, (certs / "ca.crt").read_bytes()):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(doc))

    corefile = workdir / "Corefile"
    kubernetes = (
        f"kubernetes {CLUSTER_DOMAIN} {{\n    kubeconfig {cluster.kubeconfig}\n    pods insecure\n  }}"
    )
    corefile.write_text(f".:53 {{\n  bind {node_ip}\n  errors\n  {kubernetes}\n}}\n")
    dns = spawn("coredns", [str(cache / "bin" / "coredns"), "-conf", str(corefile)])

    def resolving() -> bool:
        try:
            return bool(dns_query((node_ip, 53), f"kubernetes.default.svc.{CLUSTER_DOMAIN}"))
        except OSError:
            return False

    wait("cluster DNS (CoreDNS) on the real node's address", resolving, {"coredns": dns})
    return Lws(webhook_url=url, dns=f"{node_ip}:53", log=cluster.workdir / "logs" / "lws.log")
