"""A one-file OCI image archive, written here (no builder needed): the node's pod sandbox (pause) image.

`ctr images import` reads the archive and names the image after the `io.containerd.image.name`
annotation of its index.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path


def _blob(tar: tarfile.TarFile, data: bytes, media_type: str) -> dict[str, object]:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}


def _json(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def single_binary_image(binary: Path, ref: str, out: Path) -> Path:
    """Writes to `out` an OCI archive of image `ref` whose root holds only `binary` (as /name, 0755),
    which is also its entrypoint. The same input gives the same bytes (fixed times, sorted keys)."""
    layer_buf = io.BytesIO()
    with tarfile.open(fileobj=layer_buf, mode="w") as layer:
        info = tarfile.TarInfo(binary.name)
        data = binary.read_bytes()
        info.size, info.mode, info.mtime = len(data), 0o755, 0
        layer.addfile(info, io.BytesIO(data))
    layer_bytes = layer_buf.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer_bytes).hexdigest()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": [f"/{binary.name}"], "User": "65535:65535"},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }
    with tarfile.open(out, "w") as tar:
        layer_desc = _blob(tar, layer_bytes, "application/vnd.oci.image.layer.v1.tar")
        config_desc = _blob(tar, _json(config), "application/vnd.oci.image.config.v1+json")
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": config_desc,
            "layers": [layer_desc],
        }
        manifest_desc = _blob(tar, _json(manifest), "application/vnd.oci.image.manifest.v1+json")
        manifest_desc["annotations"] = {
            "io.containerd.image.name": ref,
            "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[-1],
        }
        for name, data in (
            ("oci-layout", _json({"imageLayoutVersion": "1.0.0"})),
            ("index.json", _json({"schemaVersion": 2, "manifests": [manifest_desc]})),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out
