"""Seeded rows' sampling noise, one launch for all of them: `reference.fill_seeded_noise`'s hash.

Each value is murmur3's 32-bit finaliser applied twice, to the column mixed with the row key's low
half and then with its high half (why: `service/engine/runner/seeded_noise.py`); the top 23 bits
make a uniform u in (0, 1), and the noise is -log(u). Programs tile (seeded row, BLOCK columns). The
integer hash and u are the reference's bit for bit; -log may differ from PyTorch's in the last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.pdl import await_inputs


@triton.jit
def _fmix32(x):  # uint32 in, uint32 out; the products taken in 64 bits and cut to 32, as C's wrap
    x = x ^ (x >> 16)
    x = ((x.to(tl.uint64) * 0x85EBCA6B) & 0xFFFFFFFF).to(tl.uint32)
    x = x ^ (x >> 13)
    x = ((x.to(tl.uint64) * 0xC2B2AE35) & 0xFFFFFFFF).to(tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _seeded_noise_kernel(
    noise_ptr,  # [num_rows, vocab] float32
    uniform_ptr,  # [num_rows] float32 (WITH_UNIFORM)
    seeded_ptr,  # [s, 3] int32: row, key low, key high
    vocab,
    stride_noise,
    WITH_UNIFORM: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # pdl.flags: launched early, waits in await_inputs
):
    await_inputs(PDL)
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(seeded_ptr + 3 * i).to(tl.int64)
    low = tl.load(seeded_ptr + 3 * i + 1).to(tl.uint32, bitcast=True)
    high = tl.load(seeded_ptr + 3 * i + 2).to(tl.uint32, bitcast=True)
    bits = _fmix32(_fmix32(cols.to(tl.uint32) ^ low) ^ high)
    u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # 2 ** -23
    tl.store(noise_ptr + row * stride_noise + cols, -tl.log(u), mask=cols < vocab)
    if WITH_UNIFORM:
        tl.store(uniform_ptr + row + cols * 0, u, mask=cols == vocab)


_BLOCK = 1024


def fill_seeded_noise(
    noise: torch.Tensor,
    seeded: torch.Tensor,
    uniform: torch.Tensor | None = None,
) -> None:
    if noise.dtype != torch.float32 or noise.stride(1) != 1 or seeded.dtype != torch.int32:
        raise ValueError(f"fill_seeded_noise: noise {noise.dtype} {noise.stride()}, seeded {seeded.dtype}")
    if seeded.shape[0] == 0:
        return
    vocab = noise.shape[1]
    columns = vocab + (uniform is not None)
    grid = (seeded.shape[0], triton.cdiv(columns, _BLOCK))
    _seeded_noise_kernel[grid](
        noise, noise if uniform is None else uniform, seeded.contiguous(), vocab, noise.stride(0),
        WITH_UNIFORM=uniform is not None, BLOCK=_BLOCK, **pdl.flags(noise),
    )  # fmt: skip
