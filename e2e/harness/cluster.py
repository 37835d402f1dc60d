"""A local Kubernetes control plane with simulated GPU nodes, for the e2e tests and `make cluster`.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok run as host processes on free
loopback ports, with certificates made here (pki.py) and the GPU nodes of e2e/gpu_nodes.yaml. Every
component gets its own session (process group) and a pid file in the work directory, and every one of
them names the work directory on its command line: `stop()` kills the groups and then anything left
whose command line mentions the work directory, so nothing survives a teardown.

    python e2e/harness/cluster.py up [--workdir DIR] [--real-node]   # starts it, prints kubeconfig
    python e2e/harness/cluster.py down [--workdir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
E2E = HERE.parent
BUILD_SCRIPT = E2E / "tools" / "build.sh"
DEFAULT_WORKDIR = Path(tempfile.gettempdir()) / f"pagoda-cluster-{os.getuid()}"
SERVICE_CIDR = "10.96.0.0/16"
START_TIMEOUT = 90.0
KWOK_VERSION = "v0.8.0"  # as in tools/build.sh
KWOK_STAGES = ("node/fast", "node/heartbeat-with-lease", "pod/fast")


def _load(name: str) -> ModuleType:
    """Imports a sibling module by path (the e2e folder is not a package; see conftest.py)."""
    full = f"pagoda_e2e_harness_{name}"
    if full not in sys.modules:
        spec = importlib.util.spec_from_file_location(full, HERE / f"{name}.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
    return sys.modules[full]


pki = _load("pki")
nodes = _load("nodes")
realnode = _load("realnode")
images = _load("images")
metrics = _load("metrics")
lws = _load("lws")


class KubectlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{' '.join(map(str, self.cmd))} exited {self.returncode}:\n{self.stderr}"


@dataclass
class Cluster:
    """A running cluster: ours (`workdir` set) or an existing one reached through its kubeconfig."""

    kubeconfig: Path
    bin_dir: Path
    workdir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    # Files written outside `workdir` (an existing cluster has none): `remove_scratch` deletes them.
    scratch: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.env:
            path = f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
            self.env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PATH": path}

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        cmd = [str(self.bin_dir / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, env=self.env, timeout=300)
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc

    def serviceaccount_kubeconfig(self, namespace: str, name: str, duration: str = "1h") -> Path:
        """A kubeconfig that authenticates as ServiceAccount `namespace/name` (TokenRequest API), e.g.
        to run the operator with exactly the permissions its chart grants."""
        token = self.kubectl("create", "token", name, "-n", namespace, f"--duration={duration}").stdout
        token = token.strip()
        view = self.kubectl("config", "view", "--raw", "--minify", "--flatten", "-o", "json").stdout
        config = json.loads(view)
        user = f"system:serviceaccount:{namespace}:{name}"
        config["users"] = [{"name": user, "user": {"token": token}}]
        config["contexts"][0]["context"] |= {"user": user, "namespace": namespace}
        fd, path = tempfile.mkstemp(prefix=f"sa-{namespace}-{name}-", suffix=".kubeconfig", dir=self.workdir)
        with os.fdopen(fd, "w") as f:
            json.dump(config, f, indent=2)
        if self.workdir is None:
            self.scratch.append(Path(path))
        return Path(path)

    def remove_scratch(self) -> None:
        """Deletes the files this object wrote outside a workdir (kubeconfigs in the temp folder)."""
        for path in self.scratch:
            path.unlink(missing_ok=True)
        self.scratch.clear()

    def node_kubeconfig(self, node: str) -> Path:
        """A kubeconfig for kubelet `node` (system:node:<node> in system:nodes); only for our cluster."""
        assert self.workdir is not None
        name = pki.node_client(self.workdir / "pki", node)
        server = json.loads(self.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
        return _kubeconfig(self.workdir / f"{name}.kubeconfig", server, pki.Pki(self.workdir / "pki"), name)

    def stop(self) -> None:
        if self.workdir is not None:
            stop(self.workdir)


# ---------------------------------------------------------------------------------------------------
# Binaries


def ensure_binaries() -> Path:
    """Runs e2e/tools/build.sh (a no-op once the cache is built) and returns the bin directory."""
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} failed (exit {proc.returncode}); its log is above")
    return Path(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------
# Processes


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the process that started it dies (even by SIGKILL)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _spawn(workdir: Path, name: str, cmd: list[str], attached: bool) -> subprocess.Popen:
    log = open(workdir / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if attached else None,
        )
    finally:
        log.close()
    (workdir / "pids" / f"{name}.pid").write_text(str(proc.pid))
    return proc


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def leftover_pids(workdir: Path) -> list[int]:
    """Live processes whose command line mentions `workdir` (zombies have an empty one)."""
    needle = str(Path(workdir).resolve())
    me = os.getpid()
    return [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and int(p.name) != me and needle in _cmdline(int(p.name))
    ]


def stop(workdir: Path, grace: float = 2.0) -> None:
    """Stops every process of the cluster in `workdir`: process groups first, then any straggler.

    The data is throwaway, so graceful shutdown gets `grace` seconds (kube-apiserver and etcd would
    take 10-15 s to drain each other) before SIGKILL. A real node's pods go first, its host state
    (bridge, mounts, cgroups, iptables) last."""
    workdir = Path(workdir).resolve()
    try:
        realnode.stop_pods(workdir)
    finally:
        _kill(workdir, grace)
        for pidfile in (workdir / "pids").glob("*.pid"):
            pidfile.unlink()
        realnode.release(workdir)


def _kill(workdir: Path, grace: float) -> None:
    """SIGTERM, then SIGKILL, to the process groups of the pid files and to every process whose command
    line mentions `workdir` (or a folder below it)."""
    groups = []
    for pidfile in sorted((workdir / "pids").glob("*.pid")):
        pid = int(pidfile.read_text())
        if str(workdir) in _cmdline(pid):  # not a recycled pid
            groups.append(pid)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
        for pid in leftover_pids(workdir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while leftover_pids(workdir) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not leftover_pids(workdir):
            break


def _wait(what: str, check: Callable[[], bool], procs: dict[str, subprocess.Popen], workdir: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            if proc.poll() is not None:
                if "address already in use" in _tail(workdir, name):
                    raise PortTaken(f"{name}: {_tail(workdir, name, 1)}")
                raise RuntimeError(
                    f"{name} exited {proc.returncode} while waiting for {what}:\n" + _tail(workdir, name)
                )
        try:
            if check():
                return
        except (OSError, ValueError, subprocess.SubprocessError):
            pass
        time.sleep(0.2)
    logs = "\n".join(f"--- {n}\n{_tail(workdir, n)}" for n in procs)
    raise TimeoutError(f"timed out after {START_TIMEOUT:.0f}s waiting for {what}\n{logs}")


def _tail(workdir: Path, name: str, lines: int = 30) -> str:
    try:
        return "\n".join((workdir / "logs" / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _https_ok(url: str, ctx: ssl.SSLContext) -> bool:
    with urllib.request.urlopen(url, context=ctx, timeout=2) as r:
        return r.status == 200


# ---------------------------------------------------------------------------------------------------
# Start


def _kubeconfig(path: Path, server: str, p: ModuleType, user: str) -> Path:
    import base64

    def b64(f: Path) -> str:
        return base64.b64encode(f.read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "pagoda-e2e",
                "cluster": {"server": server, "certificate-authority-data": b64(p.crt("ca"))},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {"client-certificate-data": b64(p.crt(user)), "client-key-data": b64(p.key(user))},
            }
        ],
        "contexts": [{"name": "pagoda-e2e", "context": {"cluster": "pagoda-e2e", "user": user}}],
        "current-context": "pagoda-e2e",
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)
    return path


def _kwok_stage_files(bin_dir: Path) -> list[Path]:
    """kwok's default stages: copied next to the binaries by build.sh, else from the Go module cache."""
    for d in (bin_dir.parent / "kwok-stages", bin_dir / "kwok-stages"):
        if found := sorted(d.glob("*.yaml")):
            return found
    gomodcache = ""
    if shutil.which("go"):
        proc = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True)
        gomodcache = proc.stdout.strip()
    src = Path(gomodcache or Path.home() / "go/pkg/mod") / f"sigs.k8s.io/kwok@{KWOK_VERSION}/kustomize/stage"
    found = [f for d in KWOK_STAGES for f in sorted((src / d).glob("*.yaml"))]
    found = [f for f in found if f.name != "kustomization.yaml"]
    if not found:
        raise RuntimeError(f"no kwok stages next to {bin_dir} nor in {src}")
    return found


def _kwok_config(workdir: Path, bin_dir: Path) -> Path:
    out = workdir / "kwok.yaml"
    out.write_text("\n---\n".join(s.read_text() for s in _kwok_stage_files(bin_dir)))
    return out


class PortTaken(RuntimeError):
    pass


def start(
    workdir: Path,
    bin_dir: Path,
    attached: bool = True,
    catalogue: Path = nodes.CATALOGUE,
    hpa_sync_period: str = "5s",
) -> Cluster:
    """Starts a fresh cluster in `workdir` (wiped first) and waits until nodes are Ready.

    attached=True: the components die with this process (PR_SET_PDEATHSIG), for test sessions.
    A free port picked here can be taken by someone else before the component binds it: then the
    whole start is tried again with new ports.
    """
    for attempt in range(3):
        try:
            return _start(Path(workdir).resolve(), bin_dir, attached, catalogue, hpa_sync_period)
        except PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _start(workdir: Path, bin_dir: Path, attached: bool, catalogue: Path, hpa_sync_period: str) -> Cluster:
    if workdir.exists():
        stop(workdir)
        shutil.rmtree(workdir)
    for sub in ("logs", "pids"):
        (workdir / sub).mkdir(parents=True)
    (workdir / "owner.pid").write_text(str(os.getpid()))
    t0 = time.monotonic()
    p = pki.generate(workdir / "pki")
    etcd_port, peer_port, api_port, kcm_port, sched_port = _free_ports(5)
    server = f"https://127.0.0.1:{api_port}"
    admin = _kubeconfig(workdir / "kubeconfig", server, p, "admin")
    kcm_kc = _kubeconfig(workdir / "kube-controller-manager.kubeconfig", server, p, "kube-controller-manager")
    sched_kc = _kubeconfig(workdir / "kube-scheduler.kubeconfig", server, p, "kube-scheduler")
    procs: dict[str, subprocess.Popen] = {}
    cluster = Cluster(kubeconfig=admin, bin_dir=bin_dir, workdir=workdir)
    try:
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        procs["etcd"] = _spawn(workdir, "etcd", [
            str(bin_dir / "etcd"), "--name=pagoda", f"--data-dir={workdir}/etcd",
            f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=pagoda={peer_url}", "--unsafe-no-fsync", "--log-level=warn",
            "--auto-compaction-retention=1", "--quota-backend-bytes=2147483648",
        ], attached)  # fmt: skip

        def etcd_ok() -> bool:
            with urllib.request.urlopen(f"{etcd_url}/health", timeout=2) as r:
                return json.load(r).get("health") == "true"

        _wait("etcd", etcd_ok, procs, workdir)

        procs["kube-apiserver"] = _spawn(workdir, "kube-apiserver", [
            str(bin_dir / "kube-apiserver"), f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
            f"--tls-cert-file={p.crt('apiserver')}", f"--tls-private-key-file={p.key('apiserver')}",
            f"--client-ca-file={p.crt('ca')}",
            f"--service-account-key-file={workdir}/pki/sa.pub",
            f"--service-account-signing-key-file={p.key('sa')}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--authorization-mode=Node,RBAC",
            "--allow-privileged=true", "--endpoint-reconciler-type=none",
            # kubeadm's order: the real node's name resolves nowhere, its InternalIP is its own.
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            # Aggregation layer: the front proxy's client certificate, trusted by extension API servers.
            f"--requestheader-client-ca-file={p.crt('front-proxy-ca')}",
            f"--requestheader-allowed-names={pki.FRONT_PROXY_CLIENT}",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={p.crt(pki.FRONT_PROXY_CLIENT)}",
            f"--proxy-client-key-file={p.key(pki.FRONT_PROXY_CLIENT)}",
        ], attached)  # fmt: skip
        admin_ctx = ssl.create_default_context(cafile=str(p.crt("ca")))
        admin_ctx.load_cert_chain(str(p.crt("admin")), str(p.key("admin")))
        _wait("kube-apiserver /readyz", lambda: _https_ok(f"{server}/readyz", admin_ctx), procs, workdir)

        procs["kube-controller-manager"] = _spawn(workdir, "kube-controller-manager", [
            str(bin_dir / "kube-controller-manager"), f"--kubeconfig={kcm_kc}",
            f"--authentication-kubeconfig={kcm_kc}", f"--authorization-kubeconfig={kcm_kc}",
            "--bind-address=127.0.0.1", f"--secure-port={kcm_port}", "--leader-elect=false",
            "--use-service-account-credentials=true", f"--root-ca-file={p.crt('ca')}",
            f"--service-account-private-key-file={p.key('sa')}",
            f"--cluster-signing-cert-file={p.crt('ca')}", f"--cluster-signing-key-file={p.key('ca')}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--horizontal-pod-autoscaler-sync-period={hpa_sync_period}",
            "--horizontal-pod-autoscaler-downscale-stabilization=15s",
        ], attached)  # fmt: skip
        procs["kube-scheduler"] = _spawn(workdir, "kube-scheduler", [
            str(bin_dir / "kube-scheduler"), f"--kubeconfig={sched_kc}",
            f"--authentication-kubeconfig={sched_kc}", f"--authorization-kubeconfig={sched_kc}",
            "--bind-address=127.0.0.1", f"--secure-port={sched_port}", "--leader-elect=false",
        ], attached)  # fmt: skip
        procs["kwok"] = _spawn(workdir, "kwok", [
            str(bin_dir / "kwok"), f"--kubeconfig={admin}", f"--config={_kwok_config(workdir, bin_dir)}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={nodes.KWOK_ANNOTATION}=fake",
            "--node-ip=127.0.0.1", "--node-lease-duration-seconds=40", "--cidr=10.0.0.0/16",
        ], attached)  # fmt: skip

        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        for what, port in (("kube-controller-manager", kcm_port), ("kube-scheduler", sched_port)):
            url = f"https://127.0.0.1:{port}/healthz"
            _wait(f"{what} /healthz", lambda url=url: _https_ok(url, insecure), procs, workdir)

        manifests = nodes.node_manifests(catalogue)
        cluster.kubectl(
            "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests})
        )

        def nodes_ready() -> bool:
            out = cluster.kubectl("get", "nodes", "-o", "json", check=False).stdout
            items = json.loads(out)["items"] if out else []
            ready = {
                n["metadata"]["name"]
                for n in items
                for c in n.get("status", {}).get("conditions", [])
                if c["type"] == "Ready" and c["status"] == "True"
            }
            return ready >= {m["metadata"]["name"] for m in manifests}

        _wait("the simulated nodes to be Ready", nodes_ready, procs, workdir)
        _wait(
            "the default ServiceAccount",
            lambda: cluster.kubectl("get", "serviceaccount", "default", check=False).returncode == 0,
            procs,
            workdir,
        )
    except BaseException:
        stop(workdir)
        raise
    (workdir / "started").write_text(f"{time.monotonic() - t0:.1f}\n")
    return cluster


def start_real_node(cluster: Cluster, attached: bool = True) -> Any:
    """Adds this machine as a real node (realnode.py) to our `cluster`, with GPU Feature Discovery's
    labels and the fake device plugin's nvidia.com/gpu for realnode.GPU; returns a realnode.RealNode.
    Raises realnode.Unavailable (with the reason) when this machine cannot run it."""
    if cluster.workdir is None:
        raise realnode.Unavailable("the real node joins only a cluster this harness started")
    if reason := realnode.unavailable_reason():
        raise realnode.Unavailable(reason)
    node_bin = realnode.ensure_binaries()
    workdir = cluster.workdir
    try:
        return realnode.start(
            cluster,
            node_bin,
            spawn=lambda name, cmd: _spawn(workdir, name, cmd, attached),
            wait=lambda what, check, procs: _wait(what, check, procs, workdir),
            free_ports=_free_ports,
            is_alive=lambda d: bool(leftover_pids(d)),
            labels=nodes.gfd_labels(realnode.GPU["product"], realnode.GPU, realnode.NUM_GPUS),
            num_gpus=realnode.NUM_GPUS,
        )
    except BaseException:
        _kill(workdir / "node", grace=2.0)  # containerd, kubelet, kube-proxy, shims: all name node/
        realnode.release(workdir)
        raise


def start_metrics(cluster: Cluster, attached: bool = True) -> Any:
    """Starts the metrics pipeline (metrics.py: Prometheus, prometheus-adapter and the custom metrics
    APIServices) for our `cluster`; returns a metrics.MetricsPipeline. Stopped with the cluster."""
    assert cluster.workdir is not None
    workdir = cluster.workdir
    return metrics.start(
        cluster,
        helm=cluster.bin_dir / "helm",
        bin_dir=metrics.ensure_binaries(),
        spawn=lambda name, cmd: _spawn(workdir, name, cmd, attached),
        wait=lambda what, check, procs: _wait(what, check, procs, workdir),
        free_ports=_free_ports,
    )


def start_lws(cluster: Cluster, attached: bool = True) -> Any:
    """Starts LeaderWorkerSet (its CRD, controller and webhooks) and cluster DNS (lws.py) for our `cluster`,
    whose real node must run; returns a lws.Lws. Stopped with the cluster."""
    assert cluster.workdir is not None
    workdir = cluster.workdir
    return lws.start(
        cluster,
        pki,
        realnode.NODE_IP,
        spawn=lambda name, cmd: _spawn(workdir, name, cmd, attached),
        wait=lambda what, check, procs: _wait(what, check, procs, workdir),
        free_ports=_free_ports,
    )


def build_images(cluster: Cluster, node: Any, attached: bool = True) -> dict[str, str]:
    """The server and operator images, built from docker/ when their inputs changed (images.py) and
    imported into the real `node`; returns {"server": ref, "operator": ref}."""
    assert cluster.workdir is not None
    workdir = cluster.workdir
    cache = realnode.cache_dir() / "images"

    def stop_dockerd() -> None:
        _kill(workdir / "docker", grace=5.0)
        realnode.unmount_under(cache / "docker", workdir / "docker")

    spawn = lambda name, cmd: _spawn(workdir, name, cmd, attached)  # noqa: E731
    return images.ensure_images(node, workdir, cache, spawn, stop_dockerd)


# ---------------------------------------------------------------------------------------------------
# Command line (`make cluster`, `make cluster-down`)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["up", "down"])
    ap.add_argument("--real-node", action="store_true", help="also join this machine as a real node (root)")
    ap.add_argument(
        "--workdir", type=Path, default=Path(os.environ.get("PAGODA_CLUSTER_DIR", DEFAULT_WORKDIR))
    )
    args = ap.parse_args(argv)
    if args.action == "down":
        if args.workdir.exists():
            stop(args.workdir)
            shutil.rmtree(args.workdir)
        print(f"stopped the cluster in {args.workdir}")
        return 0
    bin_dir = ensure_binaries()
    t0 = time.monotonic()
    cluster = start(args.workdir, bin_dir, attached=False)
    if args.real_node:
        try:
            start_real_node(cluster, attached=False)
        except BaseException:
            stop(args.workdir)
            raise
    print(cluster.kubectl("get", "nodes", "-L", "nvidia.com/gpu.product,nvidia.com/gpu.count").stdout, end="")
    print(f"cluster up in {time.monotonic() - t0:.1f}s; logs in {args.workdir}/logs")
    print("stop it with `make cluster-down`")
    print(f"export KUBECONFIG={cluster.kubeconfig} PATH={bin_dir}:$PATH")
    print(cluster.kubeconfig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
