"""`pagoda download` against a local HTTP server that speaks the Hub's API: files, token, mirror, errors."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from pagoda.cli import main

FILES = {"config.json": b'{"a": 1}', "tokenizer.json": b"{}", "sub/model.safetensors": b"\x00" * 3_000_000}
COMMIT = "0123abcd"


class Hub(http.server.BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[str, str | None]]] = []

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("Authorization")))
        if self.headers.get("Authorization") != "Bearer secret":
            self.send_error(401, "gated model")
            return
        if self.path == "/api/models/org/tiny/revision/v1":
            body = json.dumps({"sha": COMMIT, "siblings": [{"rfilename": f} for f in FILES]}).encode()
        elif self.path.startswith(f"/org/tiny/resolve/{COMMIT}/"):
            body = FILES[self.path.split(f"/resolve/{COMMIT}/", 1)[1]]
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hub() -> Iterator[str]:
    Hub.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_downloads_every_file_from_the_mirror_with_the_token(hub: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "secret")
    monkeypatch.setenv("HF_ENDPOINT", hub)  # a mirror, as an air-gapped cluster would have
    target = tmp_path / "m"
    assert main(["download", "--repo", "org/tiny", "--revision", "v1", "--target", str(target)]) == 0
    for name, data in FILES.items():
        assert (target / name).read_bytes() == data
    assert (target / ".pagoda-complete").read_text().strip() == COMMIT
    assert not list(target.rglob("*.partial"))
    requests = len(Hub.seen)
    assert main(["download", "--repo", "org/tiny", "--revision", "v1", "--target", str(target)]) == 0
    assert len(Hub.seen) == requests + 1  # a complete folder: only the revision is asked again


def test_a_refused_token_fails_with_one_line(hub: str, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    code = main(["download", "--repo", "org/tiny", "--revision", "v1", "--target", str(tmp_path / "m"),
                 "--endpoint", hub])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"download of org/tiny@v1 from {hub} failed: HTTP Error 401")
    assert not (tmp_path / "m" / ".pagoda-complete").exists()
