"""Seeded rows' noise (`kernels.fill_seeded_noise`, its CPU reference here) against a plain-Python
reference of its hash, and as a distribution: uniform, its -log Exp(1), rows independent of each
other and of how they are chunked. The Triton kernel is checked against this reference in
tests/kernels/check_small_kernels.py. The sampler's use is in test_sampler.py (a seed draws the same
token alone or in a batch), test_sampler_reference.py (seeded draws follow the filtered distribution,
on every device) and test_speculative.py (seeded verification keeps the target distribution)."""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.kernels import reference
from pagoda.service.engine.runner.seeded_noise import row_key

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
    return ((bits >> 9) + 0.5) / (1 << 23)


def _keys(*keys: tuple[int, int]) -> torch.Tensor:
    return torch.tensor(keys, dtype=torch.int32)


def _uniform(keys: torch.Tensor, columns: int) -> torch.Tensor:
    return torch.cat([u for _, u in reference.seeded_uniform_chunks(keys, columns)])


def test_each_value_is_the_reference_hash_of_key_and_column() -> None:
    # Seeds whose hashes set the top bit of either half: int32's signed patterns and logical shifts.
    seeds = [(0, 0, 0), (7, 1, 3), (2**40 + 5, 0, 99), (-3, 2, 1), (123456789, 7, 4096)]
    full = [hash(s) & 0xFFFFFFFFFFFFFFFF for s in seeds]
    assert any(k >> 63 for k in full) and any((k >> 31) & 1 for k in full)
    got = _uniform(_keys(*(row_key(*s) for s in seeds)), 4096)
    for row, key in enumerate(full):
        for col in [0, 1, 2, 255, 1000, 4095]:
            assert float(got[row, col]) == _reference(key, col), (row, col)  # exact in float32


def test_rows_are_uniform_their_logs_exp1_and_independent_of_each_other() -> None:
    uniform = _uniform(_keys(*(row_key(seed, 0, 0) for seed in range(64))), 4096).double()
    assert uniform.min() > 0 and uniform.max() < 1
    assert uniform.mean() == pytest.approx(0.5, abs=0.003)  # 262,144 draws: the mean's sd is 0.0006
    noise = -uniform.log()
    assert noise.mean() == pytest.approx(1.0, abs=0.01)
    assert noise.var() == pytest.approx(1.0, abs=0.03)
    assert (noise > math.log(2)).double().mean() == pytest.approx(0.5, abs=0.005)  # the median
    # Neighbouring columns and neighbouring seeds: no correlation beyond noise (sd 1 / sqrt(n)).
    centred = noise - 1.0
    assert (centred[:, 1:] * centred[:, :-1]).mean() == pytest.approx(0.0, abs=0.01)
    assert (centred[1:] * centred[:-1]).mean() == pytest.approx(0.0, abs=0.01)


def test_each_half_of_the_key_changes_the_row() -> None:
    uniform = _uniform(_keys((5, 9), (6, 9), (5, 10), (5, 9)), 256)
    assert torch.equal(uniform[0], uniform[3])
    assert not torch.isclose(uniform[0], uniform[1]).any()  # the low half
    assert not torch.isclose(uniform[0], uniform[2]).any()  # the high half


def test_chunks_cover_the_rows_in_order_each_as_drawn_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = _keys(*(row_key(seed, 1, 2) for seed in range(7)))
    alone = torch.cat([_uniform(keys[i : i + 1], 300) for i in range(7)])
    monkeypatch.setattr(reference, "SEEDED_ROWS_PER_CHUNK", 3)
    chunks = list(reference.seeded_uniform_chunks(keys, 300))
    assert [start for start, _ in chunks] == [0, 3, 6]
    assert [len(u) for _, u in chunks] == [3, 3, 1]
    assert torch.equal(torch.cat([u for _, u in chunks]), alone)


def test_fill_writes_the_seeded_rows_noise_and_the_uniform_after_the_vocabulary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(reference, "SEEDED_ROWS_PER_CHUNK", 2)  # rows of two chunks land where they go
    keys = _keys(*(row_key(seed, 0, 9) for seed in (3, 4, 5)))
    noise, uniform = torch.full((6, 100), -1.0), torch.full((6,), -1.0)
    at = torch.tensor([[4], [0], [2]], dtype=torch.int32)
    reference.fill_seeded_noise(noise, torch.cat([at, keys], 1), uniform)
    drawn = _uniform(keys, 101)
    torch.testing.assert_close(noise[[4, 0, 2]], -drawn[:, :100].log(), rtol=0, atol=0)
    assert uniform[[4, 0, 2]].tolist() == drawn[:, 100].tolist()
    assert (noise[[1, 3, 5]] == -1).all() and (uniform[[1, 3, 5]] == -1).all()  # the others untouched
    reference.fill_seeded_noise(
        noise, torch.tensor([[1, *keys[0].tolist()]], dtype=torch.int32)
    )  # no uniform
    assert torch.equal(noise[1], noise[4]) and uniform[1] == -1
