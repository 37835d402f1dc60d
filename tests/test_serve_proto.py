"""The gRPC contract: the committed stubs match proto/, and the .proto reads as documentation."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

from pagoda.devtools import protogen
from pagoda.service.grpc_gen import inference_pb2, inference_pb2_grpc

PROTO = protogen.PROTO_ROOT / "pagoda" / "v1" / "inference.proto"


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    """Regenerate with grpcio-tools: the message descriptors and the service stub must be identical."""
    descriptor_set = tmp_path / "set.pb"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--proto_path={protogen.PROTO_ROOT}",
            f"--descriptor_set_out={descriptor_set}",
            *protogen.PROTO_FILES,
        ],
        check=True,
    )
    fresh = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes()).file[0]
    messages = list(fresh.message_type)  # the Python stubs embed descriptors without json_name
    while messages:
        message = messages.pop()
        messages += message.nested_type  # a map field's entry type is a nested message
        for field in message.field:
            field.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto.FromString(inference_pb2.DESCRIPTOR.serialized_pb)
    assert fresh == committed, "service/grpc_gen drifted from proto/: python -m pagoda.devtools.protogen"

    generated = protogen.generate(tmp_path / "gen")
    fresh_grpc = next(p for p in generated if p.name == "inference_pb2_grpc.py").read_text()
    assert fresh_grpc == Path(inference_pb2_grpc.__file__).read_text()


def test_check_mode_passes() -> None:
    assert protogen.main(["--check"]) == 0


def test_enums_start_with_unspecified_zero() -> None:
    for enum in inference_pb2.DESCRIPTOR.enum_types_by_name.values():
        zero = enum.values_by_number[0].name
        assert zero.endswith("_UNSPECIFIED"), zero


def test_every_field_message_and_rpc_has_a_comment() -> None:
    lines = PROTO.read_text().splitlines()
    declaration = re.compile(r"^\s*(rpc |(optional |repeated )?[\w.]+ \w+ = \d+;|[A-Z_0-9]+ = \d+;)")
    for number, line in enumerate(lines):
        if declaration.match(line):
            previous = lines[number - 1].strip()
            assert previous.startswith("//"), f"inference.proto:{number + 1} has no comment: {line.strip()}"


def test_package_is_versioned() -> None:
    assert inference_pb2.DESCRIPTOR.package == "pagoda.v1"
    assert "Inference" in inference_pb2.DESCRIPTOR.services_by_name
