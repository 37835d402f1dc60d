"""A GGUF file's metadata and tensor table, read with `struct` over a memory map.

Why not `gguf.GGUFReader`: it builds a numpy view for every element of every array, so the embedded
SmolLM2's 49k-token vocabulary and its merges take it ~2.5 s on this machine's CPU, and a server start
reads the file in each process that needs it (the API process's tokenizer, the core's, the worker's
weights). This reads the same file in ~0.1 s; the format is short and stable (GGUF v2 and v3, as
llama.cpp's `docs/gguf.md` gives it). Dequantizing stays `gguf.quants`' job.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# value type -> (struct format, numpy dtype) for the fixed-size ones
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "?"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
# ggml tensor types numpy reads as they are; the rest are quantized blocks, handed on as bytes
_PLAIN_TENSORS: dict[int, str] = {0: "<f4", 1: "<f2", 24: "<i1", 25: "<i2", 26: "<i4", 27: "<i8", 28: "<f8"}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # as the file gives it: the fastest-varying dimension first
    tensor_type: int  # a `gguf.GGMLQuantizationType` value
    data: np.ndarray  # typed for plain types, else uint8 rows of blocks (what `gguf.quants` takes)


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict[str, Any]  # arrays as lists
    tensors: dict[str, GGUFTensor]


class _Cursor:
    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.offset = buffer, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        start, self.offset = self.offset, self.offset + size
        return self.buffer[start : self.offset].decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("<I"), self.unpack("<Q")
            if item_kind in _SCALARS:
                dtype = np.dtype(_SCALARS[item_kind][1])
                items = np.frombuffer(self.buffer, dtype, count, self.offset)
                self.offset += dtype.itemsize * count
                return items.tolist()
            return [self.value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self.offset}")
        return self.unpack(_SCALARS[kind][0])


def read_gguf(path: Path) -> GGUFFile:
    """The metadata and the tensors (views over the mapped file: nothing is read until used)."""
    with open(path, "rb") as file:
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(buffer)
    if buffer[:4] != _MAGIC:
        raise ValueError(f"{path}: not a GGUF file (starts {bytes(buffer[:4])!r})")
    cursor.offset = 4
    version = cursor.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} (big-endian or v1?); supported: 2 and 3")
    tensor_count, kv_count = cursor.unpack("<Q"), cursor.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
        infos.append((name, dims, cursor.unpack("<I"), cursor.unpack("<Q")))
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-cursor.offset // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in infos:
        tensors[name] = GGUFTensor(name, dims, kind, _tensor_data(buffer, start + offset, dims, kind))
    return GGUFFile(metadata, tensors)


def _tensor_data(buffer: mmap.mmap, offset: int, dims: tuple[int, ...], kind: int) -> np.ndarray:
    rows = tuple(reversed(dims))  # numpy's order: the slowest-varying dimension first
    count = int(np.prod(dims))
    if kind in _PLAIN_TENSORS:
        return np.frombuffer(buffer, _PLAIN_TENSORS[kind], count, offset).reshape(rows)
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    row_bytes = dims[0] // block_size * type_size
    return np.frombuffer(buffer, np.uint8, count // block_size * type_size, offset).reshape(
        (*rows[:-1], row_bytes)
    )
