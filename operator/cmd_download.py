"""`pagoda download`: fetch a Hugging Face model snapshot into a folder, with the standard library only.

Run by the operator's model-cache Job in the server image (nothing is pip-installed at start-up). It
speaks the Hub's HTTP API: `GET {endpoint}/api/models/{repo}/revision/{revision}` lists the files and
the commit, `GET {endpoint}/{repo}/resolve/{commit}/{file}` fetches each. HF_ENDPOINT points it at a
mirror; HTTPS_PROXY/HTTP_PROXY/NO_PROXY are honoured by urllib; HF_TOKEN authenticates (gated models).
Each file is written to a temporary name and renamed, and `.pagoda-complete` (the commit) is written
last, so a Job that is retried after a crash starts over cleanly and a finished folder is recognised.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

HELP = "Download a Hugging Face model snapshot into a folder (the operator's model-cache Job)."
COMPLETE = ".pagoda-complete"
DEFAULT_ENDPOINT = "https://huggingface.co"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repo", required=True, help="org/name on the Hub")
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


def run(args: argparse.Namespace) -> int:
    token = os.environ.get("HF_TOKEN") or None
    try:
        commit = snapshot(args.repo, args.revision, args.target, args.endpoint, token)
    except (urllib.error.URLError, OSError, ValueError) as err:
        # One line: the Job's pod ends with it as its termination message (FallbackToLogsOnError).
        print(f"download of {args.repo}@{args.revision} from {args.endpoint} failed: {err}", file=sys.stderr)
        return 1
    print(f"downloaded {args.repo}@{args.revision} (commit {commit}) into {args.target}", flush=True)
    return 0
