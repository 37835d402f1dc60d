"""The index of each row's largest value (greedy sampling's token), the first one on ties as
`torch.argmax` gives it.

PyTorch reduces a row of logits in one block, so at a few rows of a 128k vocabulary it runs a few
programs over 256 KB each (26-36 us at one row on an H100 against ~1 us of reading). Here a first launch
splits every row into BLOCK-column chunks, one program each, and keeps each chunk's maximum and where it
is; a second takes, per row, the first chunk holding the row's maximum. Values compare in float32
(exact for bf16 / fp16); a NaN counts as the largest value, as in torch.argmax (so an index is always
in the row, whatever a broken model hands it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.pdl import await_inputs


@triton.jit
def _chunk_max_kernel(
    x_ptr,  # [rows, cols]
    max_ptr,  # [rows, num_chunks] float32
    idx_ptr,  # [rows, num_chunks] int32: the column of the chunk's first maximum
    cols,
    stride_x,
    num_chunks,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # pdl.flags: launched early, waits in await_inputs
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    # Past the row's end: -inf, after every real column, so a tie there never wins.
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < cols, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN above everything, as torch.argmax ranks it
    best = tl.max(x, 0)
    # The first column holding it, by a second reduction: tl.max's own indices break ties as the
    # backend likes (the interpreter's always left).
    first = tl.min(tl.where(x == best, offs, cols), 0)
    tl.store(max_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, first)


@triton.jit
def _pick_kernel(
    max_ptr,
    idx_ptr,
    out_ptr,  # [rows] int64
    num_chunks,
    CHUNKS: tl.constexpr,  # num_chunks rounded up to a power of two
    PDL: tl.constexpr,  # pdl.flags: launched early, waits in await_inputs
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    maxima = tl.load(max_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    first = tl.min(tl.where(maxima == tl.max(maxima, 0), c, CHUNKS), 0)  # the first chunk holding it
    tl.store(out_ptr + row, tl.load(idx_ptr + row * num_chunks + first).to(tl.int64))


BLOCK = 4096  # columns a program: 32 chunks a row at Llama-3's 128,256-token vocabulary


def argmax(x: torch.Tensor) -> torch.Tensor:  # [rows, cols] -> [rows] int64
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
        raise ValueError(f"argmax: want x [rows, cols] contiguous in cols; got {tuple(x.shape)} {x.stride()}")
    rows, cols = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    num_chunks = triton.cdiv(cols, BLOCK)
    maxima = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    where = torch.empty(rows, num_chunks, dtype=torch.int32, device=x.device)
    _chunk_max_kernel[(rows, num_chunks)](
        x, maxima, where, cols, x.stride(0), num_chunks, BLOCK=BLOCK, **pdl.flags(x)
    )
    _pick_kernel[(rows,)](
        maxima, where, out, num_chunks, CHUNKS=triton.next_power_of_2(num_chunks), **pdl.flags(x)
    )
    return out
