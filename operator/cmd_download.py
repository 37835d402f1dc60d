"""`pagoda download`: fetch a model into a folder: a Hugging Face snapshot (`--repo`), or a folder or
file of an object store or web server (`--uri s3://... | gs://... | https://...`, through fsspec).

Run by the operator's model-cache Job and init container in the server image (nothing is
pip-installed at start-up). For the Hub it speaks its HTTP API with the standard library:
`GET {endpoint}/api/models/{repo}/revision/{revision}` lists the files and the commit,
`GET {endpoint}/{repo}/resolve/{commit}/{file}` fetches each. HF_ENDPOINT points it at a mirror;
HTTPS_PROXY/HTTP_PROXY/NO_PROXY are honoured by urllib; HF_TOKEN authenticates (gated models). Each file
is written to a temporary name and renamed, and `.pagoda-complete` (the commit) is written
last, so a Job that is retried after a crash starts over cleanly and a finished folder is recognised.
A `--uri` source is copied by fsspec's filesystem for its scheme (s3fs, gcsfs, HTTP), which read their
credentials from the environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS); its version is a digest of
the listing (names, sizes, ETags), written to the same marker.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import posixpath
import shutil
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

HELP = "Download a model (Hugging Face snapshot, or s3/gs/https) into a folder (the model cache)."
COMPLETE = ".pagoda-complete"
DEFAULT_ENDPOINT = "https://huggingface.co"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--repo", help="org/name on the Hub")
    source.add_argument("--uri", help="s3://bucket/path, gs://bucket/path or https://host/path/file.gguf")
    parser.add_argument("--revision", default="main", help="branch, tag or commit")
    parser.add_argument("--target", required=True, type=Path, help="folder to fill")
    parser.add_argument("--endpoint", default=os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT), help="Hub URL")


def _get(url: str, token: str | None) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    return urllib.request.urlopen(request, timeout=60)


def snapshot(repo: str, revision: str, target: Path, endpoint: str, token: str | None = None) -> str:
    """Download every file of repo@revision into target; returns the commit. Raises on any HTTP error."""
    endpoint = endpoint.rstrip("/")
    quoted = urllib.parse.quote(revision, safe="")
    with _get(f"{endpoint}/api/models/{repo}/revision/{quoted}", token) as response:
        info = json.load(response)
    commit = str(info.get("sha") or revision)
    marker = target / COMPLETE
    if marker.exists() and marker.read_text().strip() == commit:
        return commit
    target.mkdir(parents=True, exist_ok=True)
    for sibling in info.get("siblings") or ():
        name = sibling["rfilename"]
        path = (target / name).resolve()
        if not path.is_relative_to(target.resolve()):
            raise ValueError(f"{repo}: file name {name!r} leaves the target folder")
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        url = f"{endpoint}/{repo}/resolve/{commit}/{urllib.parse.quote(name)}"
        with _get(url, token) as response, partial.open("wb") as out:
            shutil.copyfileobj(response, out, length=1 << 20)
        partial.replace(path)
    marker.write_text(commit + "\n")
    return commit


def copy_uri(uri: str, target: Path) -> str:
    """Copy the file `uri`, or every file under the folder `uri`, into target; returns the version (a
    digest of the listing). Raises FileNotFoundError when nothing is there."""
    import fsspec  # the server image's; not needed for the Hub

    fs, root = fsspec.core.url_to_fs(uri)
    if fs.isfile(root):
        listing = {posixpath.basename(root): fs.info(root)}
    else:
        found = fs.find(root, detail=True)
        prefix = root.rstrip("/") + "/"
        listing = {name.removeprefix(prefix): info for name, info in found.items() if info["type"] == "file"}
    if not listing:
        raise FileNotFoundError(f"no files at {uri}")
    version = hashlib.sha256(
        json.dumps(
            [[name, info.get("size"), str(info.get("ETag") or info.get("etag") or info.get("md5Hash") or "")]
             for name, info in sorted(listing.items())]
        ).encode()
    ).hexdigest()[:16]  # fmt: skip
    marker = target / COMPLETE
    if marker.exists() and marker.read_text().strip() == version:
        return version
    target.mkdir(parents=True, exist_ok=True)
    for name, info in listing.items():
        path = (target / name).resolve()
        if not path.is_relative_to(target.resolve()):
            raise ValueError(f"{uri}: file name {name!r} leaves the target folder")
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        fs.get_file(info["name"], str(partial))
        partial.replace(path)
    marker.write_text(version + "\n")
    return version


def run(args: argparse.Namespace) -> int:
    what = args.uri or f"{args.repo}@{args.revision} from {args.endpoint}"
    try:
        if args.uri:
            version = copy_uri(args.uri, args.target)
        else:
            token = os.environ.get("HF_TOKEN") or None
            version = snapshot(args.repo, args.revision, args.target, args.endpoint, token)
    except Exception as err:  # any library's error (urllib, botocore, google-auth, fsspec)
        # One line: the Job's pod ends with it as its termination message (FallbackToLogsOnError).
        reason = " ".join(str(err).split()) or type(err).__name__
        print(f"download of {what} failed: {reason[:500]}", file=sys.stderr)
        return 1
    print(f"downloaded {what} (version {version}) into {args.target}", flush=True)
    return 0
