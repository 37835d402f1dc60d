"""Exponential noise and uniforms for seeded requests, all rows in one batched draw.

A seeded row's noise must depend on its key alone (seed, completion index, output position), not on
its neighbours in the batch, so it cannot come from the batch's shared generator. A `torch.Generator`
per row costs a generator, a fill and a copy per seeded row per step, host work that grows with the
number of seeded requests. Here each value is a counter-based hash of (key, column) instead: murmur3's
32-bit finaliser (a bijection with full avalanche) applied twice, to the column mixed with the key's
low half and then with its high half, so every row is its own pseudo-random sequence and a few
elementwise int32 ops on the device draw every seeded row at once. The top 23 bits make a uniform in
(0, 1), exact in float32 and the same on every device; the sampler's Exp(1) noise is -log(u) (which
may round differently between the CPU and a GPU, in the last bit).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

_MASK32 = 0xFFFFFFFF
# Rows hashed at a time: bounds the temporaries to a few ROWS_PER_CHUNK x columns x 4 bytes (16 MB each
# at 32 rows of a 128k vocabulary), whatever the number of seeded rows.
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


def uniform_chunks(keys: torch.Tensor, columns: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, [<= ROWS_PER_CHUNK, columns] float32 uniforms in (0, 1)) for the rows of `keys`
    ([rows, 2] int32, `row_key`'s halves) in order, row i a function of keys[i] alone. Chunks, so that
    the caller writes each where it goes without a [rows, columns] buffer of its own."""
    cols = torch.arange(columns, dtype=torch.int32, device=keys.device).view(1, -1)
    for start in range(0, keys.shape[0], ROWS_PER_CHUNK):
        chunk = keys[start : start + ROWS_PER_CHUNK]
        bits = _fmix32(_fmix32(cols ^ chunk[:, :1]) ^ chunk[:, 1:])
        # The top 23 bits, centred: in (0, 1) and exact in float32 (24 significant bits).
        yield start, (_shr(bits, 9).float() + 0.5).mul_(1.0 / (1 << 23))


def seeded_uniform(keys: torch.Tensor, columns: int) -> torch.Tensor:
    """`uniform_chunks`' rows as one [rows, columns] tensor."""
    chunks = [u for _, u in uniform_chunks(keys, columns)]
    return torch.cat(chunks) if chunks else torch.empty(0, columns, device=keys.device)
