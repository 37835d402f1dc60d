"""One real node in the test cluster: this machine, running containers (containerd + runc + CNI bridge),
with kubelet and kube-proxy at the control plane's version (e2e/tools/build-node.sh).

Host-wide pieces (a bridge, a cgroup subtree, kube-proxy's iptables chains, fixed kubelet ports are
not needed) exist once per machine, so one real node runs at a time: `start` takes the machine
(`/run/pagoda-real-node.owner` names the work directory holding it) and refuses while another live
one holds it. `stop` kills the pods' processes through their cgroups, the daemons by work directory,
unmounts what they mounted and removes the bridge, the cgroups and the iptables chains.

The node's address is the bridge's gateway (10.244.0.1): non-loopback, its own, and reachable from
the host (kube-apiserver -> kubelet for logs/exec) and from the pods.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE.parent / "tools" / "build-node.sh"
DEPS_SCRIPT = HERE.parent / "tools" / "node-deps.sh"
NODE_NAME = "pagoda-real-0"
BRIDGE = "pagoda-br0"
NODE_IP = "10.244.0.1"
POD_CIDR = "10.244.0.0/24"
CGROUP_ROOT = "pagoda-real-node"
CGROUPS = Path("/sys/fs/cgroup")
OWNER = Path("/run/pagoda-real-node.owner")
PAUSE_REF = "registry.k8s.io/pause:3.10"
API_RELAY_PORT = 6443  # on NODE_IP: the `kubernetes` Service's endpoint (relay.py)
CNI_BIN = Path("/usr/lib/cni")
# The kubelet's device manager listens here whatever its --root-dir (pluginapi.KubeletSocket).
DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")
# The GPU the real node claims (GFD labels, allocatable nvidia.com/gpu from the fake device plugin): an
# Ampere part that no simulated node has, so the operator's profile (bf16, TP 1) can pick only this node
# for it; the server in the pod finds no GPU and runs on the CPU.
GPU = {"product": "NVIDIA-A10", "family": "ampere", "compute": "8.6", "memory": "23028"}
NUM_GPUS = 4  # a rolling update of a one-GPU replica can surge; three replicas and a surge (routing)
# The real node only runs pods that ask for it: the kwok tests' pods (any image name) stay off it.
TAINT = {"key": "pagoda.dev/real-node", "value": "true", "effect": "NoSchedule"}
TOLERATION = {"key": TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}


class Unavailable(RuntimeError):
    """This machine cannot run the real node (the message says why); tests skip with it."""


def cache_dir() -> Path:
    """${PAGODA_CACHE:-~/.cache/pagoda}, as in build.sh."""
    if env := os.environ.get("PAGODA_CACHE"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagoda"


def unavailable_reason() -> str | None:
    """Why this machine cannot run containers for the node, or None when it can."""
    if os.geteuid() != 0:
        return "the real node needs root (kubelet, containerd, a bridge, cgroups)"
    if not (CGROUPS / "memory").is_dir() and not (CGROUPS / "cgroup.controllers").exists():
        return f"no cgroup hierarchy under {CGROUPS}"
    proc = subprocess.run(["bash", str(DEPS_SCRIPT)], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"{DEPS_SCRIPT.name} failed: {proc.stderr.strip()[-500:]}"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "no overlayfs (containerd's snapshotter)"
    return None


def ensure_binaries() -> Path:
    """Runs build-node.sh (a no-op once cached) and returns its bin directory."""
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} failed (exit {proc.returncode}); its log is above")
    return Path(proc.stdout.strip().splitlines()[-1])


@dataclass
class RealNode:
    """A started real node: `name`, `ip`, and `ctr(*args)` against its containerd (namespace k8s.io)."""

    name: str
    ip: str
    workdir: Path
    bin_dir: Path

    @property
    def socket(self) -> Path:
        return self.workdir / "node" / "containerd.sock"

    def ctr(
        self, *args: str, stdin: IO[bytes] | int | None = subprocess.DEVNULL
    ) -> subprocess.CompletedProcess:
        cmd = ["ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args]
        proc = subprocess.run(cmd, stdin=stdin, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        return proc

    def images(self) -> set[str]:
        return set(self.ctr("images", "list", "--quiet").stdout.split())

    def import_image(self, archive: Path | IO[bytes]) -> None:
        """Imports an image archive (docker save or OCI; a file or a stream) into the node's containerd."""
        if isinstance(archive, Path):
            with archive.open("rb") as f:
                self.ctr("images", "import", "-", stdin=f)
        else:
            self.ctr("images", "import", "-", stdin=archive)


# ---------------------------------------------------------------------------------------------------
# Host state: bridge, cgroups, mounts, iptables


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True)


def _read(path: Path) -> str:
    """The file's text, or "" when it is gone (the kubelet removes cgroups while we read them)."""
    try:
        return path.read_text()
    except OSError:
        return ""


def _cgroup_dirs() -> list[Path]:
    """Every cgroup directory of the node, deepest first, over all mounted hierarchies."""
    found: list[Path] = []
    for hierarchy in [CGROUPS, *CGROUPS.iterdir()]:
        root = hierarchy / CGROUP_ROOT
        if root.is_dir():
            found += [Path(d) for d, _, _ in os.walk(root)]  # os.walk skips what vanishes meanwhile
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _kill_cgroups() -> None:
    """SIGKILLs every process in the node's cgroups (the pods' containers) and removes the cgroups."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = {int(pid) for d in _cgroup_dirs() for pid in _read(d / "cgroup.procs").split()}
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    for d in _cgroup_dirs():
        with contextlib.suppress(OSError):
            d.rmdir()


def unmount_under(*prefixes: Path) -> None:
    """Lazily unmounts every mount point below the prefixes, deepest first."""
    wanted = tuple(str(p.resolve()) + "/" for p in prefixes)
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if (point + "/").startswith(wanted):
            points.append(point)
    for point in sorted(set(points), key=len, reverse=True):
        _run("umount", "-l", point)


def _remove_kube_chains() -> None:
    """Removes the KUBE-* iptables chains and the rules jumping to them (kubelet's KUBE-FIREWALL and
    canaries remain after kube-proxy --cleanup)."""
    for tool in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle"):
            rules = _run(tool, "-t", table, "-S").stdout.splitlines()
            for rule in rules:
                if rule.startswith("-A ") and " -j KUBE-" in rule and not rule.split()[1].startswith("KUBE-"):
                    _run(tool, "-t", table, "-D", *rule.split()[1:])
            chains = [r.split()[1] for r in rules if r.startswith("-N KUBE-")]
            for flag in ("-F", "-X"):
                for chain in chains:
                    _run(tool, "-t", table, flag, chain)


def _kill_cni_plugins() -> None:
    """SIGKILLs CNI plugin runs still going (a sandbox set up during the teardown): their command line
    does not name the work directory, and one finishing after the bridge is removed makes it again."""
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(
                str(CNI_BIN).encode() + b"/"
            ):
                os.kill(int(proc.name), signal.SIGKILL)


def _cleanup_host(bin_dir: Path | None) -> None:
    _kill_cgroups()
    _kill_cni_plugins()
    _run("ip", "link", "del", BRIDGE)
    if DEVICE_PLUGINS.is_dir():
        for f in DEVICE_PLUGINS.iterdir():
            f.unlink()
        for d in (DEVICE_PLUGINS, DEVICE_PLUGINS.parent):  # made by the kubelet: gone when empty
            with contextlib.suppress(OSError):
                d.rmdir()
    if bin_dir is not None and (bin_dir / "kube-proxy").exists():
        _run(str(bin_dir / "kube-proxy"), "--cleanup")
    _remove_kube_chains()


def _setup_host() -> None:
    for cmd in (
        ["ip", "link", "add", BRIDGE, "type", "bridge"],
        ["ip", "addr", "add", f"{NODE_IP}/24", "dev", BRIDGE],
        ["ip", "link", "set", BRIDGE, "up"],
    ):
        proc = _run(*cmd)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
    for hierarchy in [CGROUPS, *CGROUPS.iterdir()]:
        if hierarchy.is_dir() and ((hierarchy / "cgroup.procs").exists()):
            (hierarchy / CGROUP_ROOT).mkdir(exist_ok=True)
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1")


def _take_machine(workdir: Path, is_alive: Callable[[Path], bool], timeout: float = 900.0) -> None:
    """Records `workdir` as the holder of this machine's real node. While another live one holds it
    (a concurrent test run), waits for it up to `timeout` seconds, then raises Unavailable."""
    deadline = time.monotonic() + timeout
    while True:
        with open("/run/lock/pagoda-real-node.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            holder = Path(OWNER.read_text().strip()) if OWNER.exists() else None
            if holder is None or holder == workdir or not is_alive(holder):
                OWNER.write_text(str(workdir))
                return
        if time.monotonic() > deadline:
            raise Unavailable(f"another real node holds this machine (work directory {holder})")
        time.sleep(2)


# ---------------------------------------------------------------------------------------------------
# Configuration files


def _containerd_config(node_dir: Path) -> Path:
    root = cache_dir() / "node" / "containerd"  # kept between runs: imported images stay imported
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    text = f"""version = 2
root = "{root}"
state = "{node_dir}/containerd-state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{node_dir}/containerd.sock"
[ttrpc]
  address = "{node_dir}/containerd.sock.ttrpc"
[{cri}]
  sandbox_image = "{PAUSE_REF}"
  # Writing a negative oom_score_adj is denied here even for root; runc then fails every sandbox.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [{cri}.cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{node_dir}/cni"
  [{cri}.containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
"""
    (node_dir / "cni").mkdir(parents=True, exist_ok=True)
    conflist = {
        "cniVersion": "0.4.0",
        "name": "pagoda",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR, "gateway": NODE_IP}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(node_dir / "cni-ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    (node_dir / "cni" / "10-pagoda.conflist").write_text(json.dumps(conflist, indent=1))
    path = node_dir / "containerd.toml"
    path.write_text(text)
    return path


def _kubelet_config(node_dir: Path, port: int, healthz_port: int) -> Path:
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # these machines have cgroup v1 hierarchies (1.35+ refuses them by default)
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{CGROUP_ROOT}",
        "address": NODE_IP,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        # kube-apiserver reaches the kubelet without a client certificate (test cluster on this machine).
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "failSwapOn": False,
        "registerWithTaints": [TAINT],
        "nodeStatusUpdateFrequency": "4s",
        "syncFrequency": "10s",
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        # Under disk pressure the eviction manager deletes unused images, the pause image among them
        # (containerd 1.6 does not pin it), and no pod starts again: seen once during an image build.
        # Images younger than this are never collected, so a test session keeps all of them.
        "imageMinimumGCAge": "24h",
        "evictionHard": {"memory.available": "200Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "maxPods": 30,
        # Pods resolve names at the node's own address, where lws.py's CoreDNS serves cluster.local once a
        # test needs it (a LeaderWorkerSet's workers find their leader by name); until then a lookup is
        # refused at once (nothing listens on port 53 there), not timed out.
        "clusterDNS": [NODE_IP],
        "clusterDomain": "cluster.local",
        "makeIPTablesUtilChains": False,
        "serializeImagePulls": False,
        "shutdownGracePeriod": "0s",
    }
    path = node_dir / "kubelet.yaml"
    path.write_text(json.dumps(config, indent=1))
    return path


def _kube_proxy_config(node_dir: Path, kubeconfig: Path, healthz_port: int, metrics_port: int) -> Path:
    config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": NODE_NAME,
        "mode": "iptables",
        "clusterCIDR": POD_CIDR,
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        "conntrack": {"maxPerCore": 0},  # leave the host's conntrack sysctls alone
        "iptables": {"localhostNodePorts": False},
    }
    path = node_dir / "kube-proxy.yaml"
    path.write_text(json.dumps(config, indent=1))
    return path


# ---------------------------------------------------------------------------------------------------
# Start / stop


def start(
    cluster: Any,
    node_bin: Path,
    spawn: Callable[[str, list[str]], subprocess.Popen],
    wait: Callable[[str, Callable[[], bool], dict[str, subprocess.Popen]], None],
    free_ports: Callable[[int], list[int]],
    is_alive: Callable[[Path], bool],
    labels: dict[str, str] | None = None,
    num_gpus: int = 0,
) -> RealNode:
    """Starts containerd, kubelet and kube-proxy for `cluster` (its workdir holds their state), and with
    `num_gpus` the fake GPU device plugin (a test double), and waits until the node is Ready with that
    many allocatable nvidia.com/gpu. Raises Unavailable when another real node holds this machine."""
    workdir = cluster.workdir
    node_dir = workdir / "node"
    node_dir.mkdir(parents=True, exist_ok=True)
    (node_dir / "bin-dir").write_text(str(node_bin))
    _take_machine(workdir, is_alive)
    node = RealNode(NODE_NAME, NODE_IP, workdir, node_bin)
    try:
        _cleanup_host(node_bin)
        _setup_host()
        port, healthz, proxy_healthz, proxy_metrics = free_ports(4)
        procs = {
            "containerd": spawn("containerd", ["containerd", "--config", str(_containerd_config(node_dir))])
        }
        wait(
            "containerd", lambda: _run("ctr", "--address", str(node.socket), "version").returncode == 0, procs
        )
        pause_tar = node_dir / "pause.oci.tar"
        oci_single_binary_image(node_bin / "pause", PAUSE_REF, pause_tar)
        remove_containers(node.socket)  # left by a run that did not get to its teardown
        node.import_image(pause_tar)
        procs["kubelet"] = spawn("kubelet", [
            str(node_bin / "kubelet"), f"--config={_kubelet_config(node_dir, port, healthz)}",
            f"--kubeconfig={cluster.node_kubeconfig(NODE_NAME)}", f"--root-dir={node_dir}/kubelet",
            f"--container-runtime-endpoint=unix://{node.socket}", f"--hostname-override={NODE_NAME}",
            f"--node-ip={NODE_IP}", f"--cert-dir={node_dir}/kubelet-pki",
            "--node-labels=" + ",".join(f"{k}={v}" for k, v in (labels or {}).items()),
        ])  # fmt: skip
        procs["kube-proxy"] = spawn("kube-proxy", [
            str(node_bin / "kube-proxy"),
            f"--config={_kube_proxy_config(node_dir, cluster.kubeconfig, proxy_healthz, proxy_metrics)}",
        ])  # fmt: skip
        wait(f"node {NODE_NAME} Ready", lambda: _is_ready(cluster, NODE_NAME), procs)
        procs["relay"] = _relay_api(cluster, spawn)
        if num_gpus:
            procs["fake-gpu-plugin"] = spawn("fake-gpu-plugin", [
                sys.executable, str(HERE / "fake_gpu_plugin.py"), f"--count={num_gpus}",
                f"--plugin-dir={DEVICE_PLUGINS}", f"--stubs={node_dir}/deviceplugin-stubs",
            ])  # fmt: skip
            wait(
                f"{num_gpus} nvidia.com/gpu on {NODE_NAME}",
                lambda: _gpus(cluster, NODE_NAME) == num_gpus,
                procs,
            )
    except BaseException:
        stop_pods(workdir)
        raise
    return node


def _relay_api(cluster: Any, spawn: Callable[[str, list[str]], subprocess.Popen]) -> subprocess.Popen:
    """Pods reach kube-apiserver (on loopback) at the `kubernetes` Service: relay.py on the node's
    address, named as that Service's endpoint (kube-apiserver runs with --endpoint-reconciler-type=none)."""
    server = json.loads(cluster.kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    proc = spawn("relay", [
        sys.executable, str(HERE / "relay.py"), f"--listen={NODE_IP}:{API_RELAY_PORT}",
        f"--to={server.removeprefix('https://')}", f"--tag={cluster.workdir}",
    ])  # fmt: skip
    endpoints = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "kubernetes-real-node",
            "namespace": "default",
            "labels": {
                "kubernetes.io/service-name": "kubernetes",
                "endpointslice.kubernetes.io/managed-by": "pagoda-e2e-harness",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [NODE_IP], "conditions": {"ready": True}}],
        "ports": [{"name": "https", "port": API_RELAY_PORT, "protocol": "TCP"}],
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(endpoints))
    return proc


def _gpus(cluster: Any, name: str) -> int:
    out = cluster.kubectl("get", "node", name, "-o", "jsonpath={.status.allocatable.nvidia\\.com/gpu}").stdout
    return int(out or 0)


def _is_ready(cluster: Any, name: str) -> bool:
    out = cluster.kubectl("get", "node", name, "-o", "json", check=False).stdout
    conditions = json.loads(out)["status"].get("conditions", []) if out else []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _holds_machine(workdir: Path) -> bool:
    return OWNER.exists() and Path(OWNER.read_text().strip()) == Path(workdir).resolve()


def stop_pods(workdir: Path) -> None:
    """First step of a teardown: kills the pods' processes (before the kubelet and the shims go) and
    deletes their containers from containerd's root, which is kept between runs."""
    if _holds_machine(workdir):
        _kill_cgroups()
        socket = Path(workdir).resolve() / "node" / "containerd.sock"
        if socket.exists():
            remove_containers(socket)


def remove_containers(socket: Path) -> None:
    """Deletes every container (and its snapshot) of namespace k8s.io. A container's snapshot keeps
    its image's layers: without this, each image generation ever run stays on disk (~12 GB each)."""
    ctr = ["ctr", "--address", str(socket), "--namespace", "k8s.io"]
    for task in _run(*ctr, "tasks", "list", "--quiet").stdout.split():
        _run(*ctr, "tasks", "delete", "--force", task)
    ids = _run(*ctr, "containers", "list", "--quiet").stdout.split()
    if ids:
        _run(*ctr, "containers", "delete", *ids)


def release(workdir: Path) -> None:
    """Last step of a teardown, once the daemons are dead: unmounts what they mounted, removes the
    bridge, cgroups and iptables chains, and gives the machine back."""
    workdir = Path(workdir).resolve()
    if not _holds_machine(workdir):
        return
    unmount_under(workdir / "node", cache_dir() / "node" / "containerd")
    bin_file = workdir / "node" / "bin-dir"
    _cleanup_host(Path(bin_file.read_text()) if bin_file.exists() else None)
    OWNER.unlink(missing_ok=True)


def oci_single_binary_image(binary: Path, ref: str, out: Path) -> Path:
    import importlib.util
    import sys

    name = "pagoda_e2e_harness_oci"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "oci.py")
        assert spec and spec.loader
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name].single_binary_image(binary, ref, out)
