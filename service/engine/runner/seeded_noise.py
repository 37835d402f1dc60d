"""Exponential noise and uniforms for seeded requests, all rows in one batched draw.

A seeded row's noise must depend on its key alone (seed, completion index, output position), not on
its neighbours in the batch, so it cannot come from the batch's shared generator. A `torch.Generator`
per row costs a generator, a fill and a copy per seeded row per step, host work that grows with the
number of seeded requests. Here each value is a counter-based hash of (key, column) instead: murmur3's
32-bit finaliser (a bijection with full avalanche) applied twice, to the column mixed with the key's
low half and then with its high half, so every row is its own pseudo-random sequence and a few
elementwise int32 ops on the device draw every seeded row at once. The top 24 bits make a uniform in
(0, 1) exactly in float32 (`seeded_uniform`), and -log(u) an Exp(1) draw (`seeded_exponential`). The
integer part is the same on every device; the logarithm may round differently between the CPU and a
GPU (the last bit).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
# Rows hashed at a time: bounds the int32 temporaries to ~4 x ROWS_PER_CHUNK x vocab x 4 bytes
# (32 rows of a 128k vocabulary: ~64 MB), whatever the number of seeded rows.
ROWS_PER_CHUNK = 32


def _signed32(value: int) -> int:
    """A 32-bit pattern as the int32 that holds it."""
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 bit patterns (torch's >> on int32 is arithmetic)."""
    return (x >> bits) & ((1 << (32 - bits)) - 1)


_C1 = _signed32(0x85EBCA6B)
_C2 = _signed32(0xC2B2AE35)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on int32 bit patterns (products wrap modulo 2**32, as in C)."""
    x = x ^ _shr(x, 16)
    x = x * _C1
    x = x ^ _shr(x, 13)
    x = x * _C2
    return x ^ _shr(x, 16)


def row_key(seed: int, index: int, position: int) -> tuple[int, int]:
    """A seeded row's key as two int32 halves: from the request's seed, which of its n completions,
    which output token. `hash` of a tuple of ints is the same in every process (no string hashing)."""
    key = hash((seed, index, position))
    return _signed32(key), _signed32(key >> 32)


def seeded_uniform(keys: torch.Tensor, columns: int) -> torch.Tensor:
    """[rows, columns] float32 uniforms in (0, 1) on keys' device, row i a function of keys[i] alone.
    `keys`: [rows, 2] int32, `row_key`'s halves."""
    return _draw(keys, columns, exponential=False)


def seeded_exponential(keys: torch.Tensor, columns: int) -> torch.Tensor:
    """[rows, columns] float32 Exp(1) draws: -log of `seeded_uniform`'s."""
    return _draw(keys, columns, exponential=True)


def _draw(keys: torch.Tensor, columns: int, exponential: bool) -> torch.Tensor:
    out = torch.empty(keys.shape[0], columns, dtype=torch.float32, device=keys.device)
    cols = torch.arange(columns, dtype=torch.int32, device=keys.device).view(1, -1)
    for start in range(0, keys.shape[0], ROWS_PER_CHUNK):
        chunk = keys[start : start + ROWS_PER_CHUNK]
        rows = out[start : start + chunk.shape[0]]
        bits = _fmix32(_fmix32(cols ^ chunk[:, :1]) ^ chunk[:, 1:])
        # The top 24 bits, centred: in (0, 1) and exact in float32.
        torch.mul(_shr(bits, 8).float() + 0.5, 1.0 / (1 << 24), out=rows)
        if exponential:
            rows.log_().neg_()
    return out
