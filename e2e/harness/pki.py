"""Certificates and keys of the e2e control plane, made with the openssl command line.

One cluster CA signs the API server's serving certificate and the client certificates (admin in
`system:masters`, kube-controller-manager, kube-scheduler); a second CA, the front proxy's, signs the
client certificate the aggregator presents to extension API servers (requestheader authentication), so
a metrics adapter can register an APIService later. `sa.key`/`sa.pub` sign and verify ServiceAccount
tokens. Everything lives in one directory and is valid for a year.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVER_SANS = (
    "IP:127.0.0.1",
    "IP:10.96.0.1",
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
)
FRONT_PROXY_CLIENT = "front-proxy-client"


@dataclass(frozen=True)
class Pki:
    dir: Path

    def crt(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed:\n{proc.stderr}")


def _ca(d: Path, name: str, cn: str) -> None:
    _openssl(
        "req", "-x509", "-new", "-nodes", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
        "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "365", "-subj", f"/CN={cn}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        cwd=d,
    )  # fmt: skip


def _leaf(d: Path, name: str, ca: str, subject: str, usage: str, sans: tuple[str, ...] = ()) -> None:
    ext = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={usage}",
    ]
    if sans:
        ext.append("subjectAltName=" + ",".join(sans))
    (d / f"{name}.ext").write_text("\n".join(ext) + "\n")
    _openssl(
        "req", "-new", "-nodes", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject,
        cwd=d,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-days", "365", "-extfile", f"{name}.ext", "-out", f"{name}.crt",
        cwd=d,
    )  # fmt: skip


def node_client(d: Path, node: str) -> str:
    """Issues the client certificate of kubelet `node` (group system:nodes, as the Node authorizer
    wants) into the PKI in `d`; returns its name for Pki.crt/key."""
    name = f"node-{node}"
    _leaf(d, name, "ca", f"/O=system:nodes/CN=system:node:{node}", "clientAuth")
    return name


def generate(d: Path) -> Pki:
    """Writes the whole PKI into `d` (created) and returns it."""
    d.mkdir(parents=True, exist_ok=True)
    _ca(d, "ca", "pagoda-e2e-ca")
    _ca(d, "front-proxy-ca", "pagoda-e2e-front-proxy-ca")
    _leaf(d, "apiserver", "ca", "/CN=kube-apiserver", "serverAuth", SERVER_SANS)
    _leaf(d, "admin", "ca", "/O=system:masters/CN=pagoda-e2e-admin", "clientAuth")
    _leaf(d, "kube-controller-manager", "ca", "/CN=system:kube-controller-manager", "clientAuth")
    _leaf(d, "kube-scheduler", "ca", "/CN=system:kube-scheduler", "clientAuth")
    _leaf(d, FRONT_PROXY_CLIENT, "front-proxy-ca", f"/CN={FRONT_PROXY_CLIENT}", "clientAuth")
    _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key", cwd=d)
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    for f in d.iterdir():
        if f.suffix in (".key", ".pub"):
            f.chmod(0o600)
    return Pki(d)
