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


# ---- s3:// against a real S3-compatible server (moto's server mode), https:// against a web server ----


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """moto's S3 server on a free port; the endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_env(s3: str, monkeypatch) -> str:
    """The environment a credentials Secret gives the download container (envFrom)."""
    for key, value in {
        "AWS_ACCESS_KEY_ID": "pagoda",
        "AWS_SECRET_ACCESS_KEY": "pagoda-secret",
        "AWS_ENDPOINT_URL": s3,
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    return s3


def _bucket(name: str, objects: dict[str, bytes]) -> None:
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket=name)
    for key, body in objects.items():
        client.put_object(Bucket=name, Key=key, Body=body)


def test_an_s3_folder_is_copied_whole_and_again_only_when_it_changes(s3_env: str, tmp_path: Path) -> None:
    _bucket("models", {f"team/tiny/{k}": v for k, v in FILES.items()} | {"team/tinier/x": b"not this"})
    target = tmp_path / "tiny"
    assert main(["download", "--uri", "s3://models/team/tiny/", "--target", str(target)]) == 0
    for name, data in FILES.items():
        assert (target / name).read_bytes() == data
    assert not (target / "x").exists() and not list(target.rglob("*.partial"))
    (target / "config.json").write_bytes(b"local edit")
    assert main(["download", "--uri", "s3://models/team/tiny", "--target", str(target)]) == 0
    assert (target / "config.json").read_bytes() == b"local edit"  # same listing: nothing fetched
    _bucket("models", {"team/tiny/config.json": b'{"a": 2}'})  # a new version of one file
    assert main(["download", "--uri", "s3://models/team/tiny", "--target", str(target)]) == 0
    assert (target / "config.json").read_bytes() == b'{"a": 2}'


def test_one_s3_file_lands_under_its_own_name(s3_env: str, tmp_path: Path) -> None:
    _bucket("ggufs", {"m/SmolLM2.Q4.gguf": b"GGUF" + b"\x01" * 100})
    assert main(["download", "--uri", "s3://ggufs/m/SmolLM2.Q4.gguf", "--target", str(tmp_path)]) == 0
    assert (tmp_path / "SmolLM2.Q4.gguf").read_bytes() == b"GGUF" + b"\x01" * 100


@pytest.mark.parametrize(
    ("uri", "said"),
    [("s3://no-such-bucket/m/", "no-such-bucket"), ("s3://empty-one/nothing/", "no files at s3://empty-one")],
)
def test_a_missing_s3_source_fails_with_one_line(
    s3_env: str, tmp_path: Path, capsys, uri: str, said: str
) -> None:
    _bucket("empty-one", {"elsewhere/x": b"1"})
    assert main(["download", "--uri", uri, "--target", str(tmp_path / "m")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"download of {uri} failed: ") and said in err and err.count("\n") == 1
    assert not (tmp_path / "m" / ".pagoda-complete").exists()


def test_an_https_file_is_fetched(tmp_path: Path) -> None:
    served = tmp_path / "www" / "models"
    served.mkdir(parents=True)
    (served / "tiny.gguf").write_bytes(b"GGUF" + b"\x02" * 5000)
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path / "www"))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}/models/tiny.gguf"
        assert main(["download", "--uri", uri, "--target", str(tmp_path / "m")]) == 0
        assert (tmp_path / "m" / "tiny.gguf").read_bytes() == b"GGUF" + b"\x02" * 5000
    finally:
        server.shutdown()
