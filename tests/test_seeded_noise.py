"""Seeded rows' noise (`runner.seeded_noise`) against a plain-Python reference of its hash, and as a
distribution: Exp(1) draws, rows independent of each other and of how they are chunked. The sampler's
use of it is in test_sampler.py (a seed draws the same token alone or in a batch) and
test_sampler_reference.py (seeded draws follow the filtered distribution, on every device)."""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.service.engine.runner import seeded_noise
from pagoda.service.engine.runner.seeded_noise import row_key, seeded_exponential, seeded_uniform

M32 = 0xFFFFFFFF


def _fmix32(x: int) -> int:
    """murmur3's finaliser on an unsigned 32-bit int, as its C source writes it."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def _reference(key: int, column: int) -> float:
    low, high = key & M32, (key >> 32) & M32
    bits = _fmix32(_fmix32(column ^ low) ^ high)
    return -math.log(((bits >> 8) + 0.5) / (1 << 24))


def _keys(*keys: tuple[int, int]) -> torch.Tensor:
    return torch.tensor(keys, dtype=torch.int32)


def test_each_value_is_the_reference_hash_of_key_and_column() -> None:
    # Seeds whose hashes set the top bit of either half: int32's signed patterns and logical shifts.
    seeds = [(0, 0, 0), (7, 1, 3), (2**40 + 5, 0, 99), (-3, 2, 1), (123456789, 7, 4096)]
    full = [hash(s) & 0xFFFFFFFFFFFFFFFF for s in seeds]
    assert any(k >> 63 for k in full) and any((k >> 31) & 1 for k in full)
    columns = [0, 1, 2, 255, 1000, 4095]
    got = seeded_exponential(_keys(*(row_key(*s) for s in seeds)), 4096)
    for row, key in enumerate(full):
        for col in columns:
            assert float(got[row, col]) == pytest.approx(_reference(key, col), rel=1e-6), (row, col)


def test_rows_are_exp1_draws_and_independent_of_each_other() -> None:
    keys = _keys(*(row_key(seed, 0, 0) for seed in range(64)))
    noise = seeded_exponential(keys, 4096).double()
    assert noise.min() > 0
    assert noise.mean() == pytest.approx(1.0, abs=0.01)  # 262,144 draws: the mean's sd is 0.002
    assert noise.var() == pytest.approx(1.0, abs=0.03)
    assert (noise > math.log(2)).double().mean() == pytest.approx(0.5, abs=0.005)  # the median
    # Neighbouring columns and neighbouring seeds: no correlation beyond noise (sd 1 / sqrt(n)).
    centred = noise - 1.0
    assert (centred[:, 1:] * centred[:, :-1]).mean() == pytest.approx(0.0, abs=0.01)
    assert (centred[1:] * centred[:-1]).mean() == pytest.approx(0.0, abs=0.01)


def test_each_half_of_the_key_changes_the_row() -> None:
    noise = seeded_exponential(_keys((5, 9), (6, 9), (5, 10), (5, 9)), 256)
    assert torch.equal(noise[0], noise[3])
    assert not torch.isclose(noise[0], noise[1]).any()  # the low half
    assert not torch.isclose(noise[0], noise[2]).any()  # the high half


def test_rows_past_a_chunk_are_the_rows_drawn_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = _keys(*(row_key(seed, 1, 2) for seed in range(7)))
    alone = torch.cat([seeded_exponential(keys[i : i + 1], 300) for i in range(7)])
    monkeypatch.setattr(seeded_noise, "ROWS_PER_CHUNK", 3)
    assert torch.equal(seeded_exponential(keys, 300), alone)


def test_the_exponential_is_minus_the_log_of_the_uniform_of_the_same_key() -> None:
    keys = _keys(*(row_key(seed, 0, 5) for seed in range(40)))  # past a chunk
    uniform = seeded_uniform(keys, 513)
    assert uniform.min() > 0 and uniform.max() < 1
    assert uniform.mean() == pytest.approx(0.5, abs=0.005)
    torch.testing.assert_close(seeded_exponential(keys, 512), -torch.log(uniform[:, :512]), rtol=0, atol=0)
