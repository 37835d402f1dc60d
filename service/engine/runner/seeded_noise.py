"""Seeded requests' sampling noise: each row's a function of its key alone, all rows in one draw.

A seeded row's noise must depend on (seed, completion index, output position) alone, not on its
neighbours in the batch, so it cannot come from the batch's shared generator. A `torch.Generator`
per row costs a generator, a fill and a copy per seeded row per step, host work that grows with the
number of seeded requests. Instead each value is a counter-based hash of (key, column)
(`kernels.fill_seeded_noise`): murmur3's 32-bit finaliser (a bijection with full avalanche) applied
twice, to the column mixed with the key's low half and then with its high half, so every row is its
own pseudo-random sequence, drawn for every seeded row at once (one launch on a GPU, a few batched
int32 ops on the CPU). The top 23 bits make a uniform u in (0, 1), exact in float32 and the same on
every device; the noise is -log(u) (which may round differently between devices, in the last bit).
Speculative verification takes its acceptance uniform from the column after the vocabulary.
"""

from __future__ import annotations


def _signed32(value: int) -> int:
    """A 32-bit pattern as the int32 that holds it."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def row_key(seed: int, index: int, position: int) -> tuple[int, int]:
    """A seeded row's key as two int32 halves: from the request's seed, which of its n completions,
    which output token. `hash` of a tuple of ints is the same in every process (no string hashing)."""
    key = hash((seed, index, position))
    return _signed32(key), _signed32(key >> 32)
