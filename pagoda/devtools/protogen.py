"""Generates the gRPC stubs in service/grpc_gen/ from proto/ with grpcio-tools.

    python -m pagoda.devtools.protogen            # rewrite service/grpc_gen/
    python -m pagoda.devtools.protogen --check    # exit 1 when the committed stubs drifted

The stubs are committed so that the serving image needs no grpcio-tools; tests/test_serve_proto.py
regenerates them into a temporary folder and compares.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILES = ["pagoda/v1/inference.proto"]
GEN_DIR = REPO_ROOT / "service" / "grpc_gen"
# protoc writes `from pagoda.v1 import inference_pb2`, which would resolve inside our own `pagoda`
# package; the stubs live flat in pagoda.service.grpc_gen instead.
IMPORT_FIXES = {
    "from pagoda.v1 import inference_pb2": "from pagoda.service.grpc_gen import inference_pb2",
}
INIT_TEXT = '"""Generated from proto/ by `python -m pagoda.devtools.protogen`; do not edit."""\n'


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs for PROTO_FILES into `out_dir` (flat); return the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--proto_path={PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *PROTO_FILES,
        ]
        subprocess.run(cmd, check=True, cwd=REPO_ROOT)
        written = []
        for path in sorted(Path(tmp).rglob("*.py*")):
            text = path.read_text()
            for old, new in IMPORT_FIXES.items():
                text = text.replace(old, new)
            target = out_dir / path.name
            target.write_text(text)
            written.append(target)
    init = out_dir / "__init__.py"
    init.write_text(INIT_TEXT)
    return [init, *written]


def diff(expected_dir: Path, actual_dir: Path) -> list[str]:
    """Names of generated files that differ between two folders (missing ones included)."""
    names = {p.name for p in expected_dir.glob("*.py*")} | {p.name for p in actual_dir.glob("*.py*")}
    return sorted(
        name
        for name in names
        if not (expected_dir / name).is_file()
        or not (actual_dir / name).is_file()
        or (expected_dir / name).read_text() != (actual_dir / name).read_text()
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on drift")
    args = parser.parse_args(argv)
    if not args.check:
        for path in generate(GEN_DIR):
            print(f"wrote {path.relative_to(REPO_ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        drifted = diff(Path(tmp), GEN_DIR)
    if drifted:
        print(f"stubs drifted from proto/: {', '.join(drifted)}; run python -m pagoda.devtools.protogen")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
