"""Our GGUF reader against the `gguf` package's own `GGUFReader`: the same metadata and the same tensor
bytes, on the embedded SmolLM2 and on a file written with every value type and a custom alignment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from pagoda.service.model.gguf_file import read_gguf


def assert_same_as_gguf_reader(path: Path) -> None:
    theirs = gguf.GGUFReader(path)
    ours = read_gguf(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == expected
    assert [type(v) for v in ours.metadata.values()] == [type(v) for v in expected.values()]
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for tensor in theirs.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.shape == tuple(int(d) for d in tensor.shape)
        assert mine.tensor_type == tensor.tensor_type
        assert mine.data.dtype == tensor.data.dtype and mine.data.shape == tensor.data.shape
        assert np.array_equal(mine.data, tensor.data), tensor.name


def test_the_embedded_model_reads_as_gguf_reads_it(smollm2_gguf: Path) -> None:
    assert_same_as_gguf_reader(smollm2_gguf)
    tokens = read_gguf(smollm2_gguf).metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and tokens[:2] == ["<|endoftext|>", "<|im_start|>"]


def test_every_value_type_and_an_alignment(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)  # not the default 32: tensors start elsewhere
    values: list[tuple[str, Any, gguf.GGUFValueType]] = [
        ("u8", 200, gguf.GGUFValueType.UINT8),
        ("i8", -100, gguf.GGUFValueType.INT8),
        ("u16", 60000, gguf.GGUFValueType.UINT16),
        ("i16", -30000, gguf.GGUFValueType.INT16),
        ("u32", 4_000_000_000, gguf.GGUFValueType.UINT32),
        ("i32", -2_000_000_000, gguf.GGUFValueType.INT32),
        ("f32", 0.5, gguf.GGUFValueType.FLOAT32),
        ("bool", True, gguf.GGUFValueType.BOOL),
        ("str", "naïve ✓", gguf.GGUFValueType.STRING),
        ("u64", 2**63 + 5, gguf.GGUFValueType.UINT64),
        ("i64", -(2**40), gguf.GGUFValueType.INT64),
        ("f64", 1e-300, gguf.GGUFValueType.FLOAT64),
    ]
    for key, value, kind in values:
        writer.add_key_value(f"test.{key}", value, kind)
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.25, -1.5])
    writer.add_array("test.strings", ["a", "", "ü", "<tool_call>"])
    writer.add_array("test.bools", [True, False])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 4, 3)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    assert_same_as_gguf_reader(path)
    ours = read_gguf(path)
    assert {k: ours.metadata[f"test.{k}"] for k, _, _ in values} == {
        k: v for k, v, _ in values if k != "f32"
    } | {"f32": 0.5}
    assert ours.metadata["test.strings"] == ["a", "", "ü", "<tool_call>"]
    assert ours.tensors["q8"].shape == (64, 4) and ours.tensors["f16"].shape == (3, 4, 2)
    dequantized = gguf.quants.dequantize(ours.tensors["q8"].data, gguf.GGMLQuantizationType.Q8_0)
    assert dequantized.shape == (4, 64)


@pytest.mark.parametrize(
    ("head", "message"),
    [
        (b"GGML\x03\x00\x00\x00", "not a GGUF file"),
        (b"GGUF\x01\x00\x00\x00", "version 1"),
        (b"GGUF\x00\x00\x00\x03", "version 50331648"),
    ],
)
def test_what_is_not_gguf_v2_or_v3_is_refused(tmp_path: Path, head: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(head + bytes(16))
    with pytest.raises(ValueError, match=message):
        read_gguf(path)
