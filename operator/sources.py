"""What a `model.source.uri` names, and the `pagoda download` command that fetches it.

`hf://org/name[@revision]` is a Hugging Face Hub snapshot (cmd_download speaks the Hub's HTTP API).
`s3://bucket/path`, `gs://bucket/path` and `http(s)://host/path/file.gguf` are copied by fsspec (s3fs,
gcsfs, its HTTP filesystem): a folder with every file under it, or one file. Credentials come from the
environment the pod gets (`model.source.credentialsSecret` as envFrom: AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for S3-compatible stores; GOOGLE_APPLICATION_CREDENTIALS or the
node's workload identity for GCS). Pure functions: manifests.py and cache.py build pods from them.
"""

from __future__ import annotations

import posixpath

HUB = "hf://"
FILE_SUFFIXES = (".gguf",)  # a source ending so is one file; anything else is a folder


def is_hub(uri: str) -> bool:
    return uri.startswith(HUB)


def hub_repo_revision(uri: str) -> tuple[str, str]:
    """("org/name", revision) of an hf:// source; revision "main" when none is given."""
    repo, _, revision = uri.removeprefix(HUB).partition("@")
    return repo, revision or "main"


def label(uri: str) -> str:
    """How status messages name the source; its digest also names the cache of this model version."""
    if is_hub(uri):
        repo, revision = hub_repo_revision(uri)
        return f"{repo}@{revision}"
    return uri


def is_file(uri: str) -> bool:
    return not is_hub(uri) and uri.lower().endswith(FILE_SUFFIXES)


def folder_name(uri: str) -> str:
    """The folder the download fills, under the model mount: the Hub repo's name, or the last part of the
    path (a file's name without its suffix)."""
    if is_hub(uri):
        return hub_repo_revision(uri)[0].split("/")[1]
    last = posixpath.basename(uri.split("://", 1)[1].rstrip("/"))
    return posixpath.splitext(last)[0] if is_file(uri) else last


def served_path(uri: str, folder: str) -> str:
    """What the server loads, given the folder the download filled: the folder, or the file in it."""
    return posixpath.join(folder, posixpath.basename(uri)) if is_file(uri) else folder


def download_command(uri: str, target: str) -> list[str]:
    """`pagoda download` of `uri` into the folder `target`."""
    if is_hub(uri):
        repo, revision = hub_repo_revision(uri)
        return ["pagoda", "download", "--repo", repo, "--revision", revision, "--target", target]
    return ["pagoda", "download", "--uri", uri, "--target", target]
