"""A multi-LoRA step's inputs, for the kernel checks (tests/kernels/check_lora.py) and `pagoda bench kernels`,
and the PyTorch peer the benchmark times the kernels against.

The inputs follow `pagoda.kernels.reference`'s layouts: adapters of ranks up to R in slots (the rows
and columns past an adapter's rank zero), the tokens in runs that share a slot (`LoraSegments`), -1 for
a run without an adapter. Values are scaled so that x, v and the update all have unit variance, the
size of y: a wrong term shows at any dtype's tolerance.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from pagoda.kernels import LoraSegments


@dataclass
class LoraInputs:
    x: torch.Tensor  # [T, K]
    a: torch.Tensor  # [num_slots, S, R, K]
    b: torch.Tensor  # [num_slots, N, R]
    y: torch.Tensor  # [T, N], the projection's output that the update adds to
    token_slots: torch.Tensor  # [T] int32
    segments: LoraSegments  # the runs of token_slots
    slice_starts: tuple[int, ...]  # S + 1


def lora_inputs(
    run_lens: list[int],  # tokens of each run, in order
    run_slots: list[int],  # the slot of each run, -1: none
    k: int,
    slice_sizes: tuple[int, ...],  # the output columns of each slice (q, k, v: 3)
    ranks: list[int],  # each slot's adapter rank; R is the largest
    dtype: torch.dtype,
    device: str | torch.device,
    generator: torch.Generator | None = None,
) -> LoraInputs:
    """Random adapters in `len(ranks)` slots and a step of `sum(run_lens)` tokens in those runs."""
    rank = max(ranks)

    def randn(*shape: int) -> torch.Tensor:  # drawn in float32 on the CPU: the same values on every device
        return torch.randn(*shape, generator=generator)

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    num_slots, num_slices, n = len(ranks), len(slice_sizes), sum(slice_sizes)
    used = torch.arange(rank).view(1, -1) < torch.tensor(ranks).view(-1, 1)  # [num_slots, R]
    a = randn(num_slots, num_slices, rank, k) * k**-0.5 * used.view(num_slots, 1, rank, 1)
    b = randn(num_slots, n, rank) * rank**-0.5 * used.view(num_slots, 1, rank)
    lens = torch.tensor(run_lens, dtype=torch.int32)
    slots = torch.tensor(run_slots, dtype=torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
    num_tokens = int(starts[-1])
    return LoraInputs(
        x=put(randn(num_tokens, k)),
        a=put(a),
        b=put(b),
        y=put(randn(num_tokens, n)),
        token_slots=slots.repeat_interleave(lens).to(device),
        segments=LoraSegments(starts.to(device), slots.to(device), max(run_lens, default=0)),
        slice_starts=(0, *itertools.accumulate(slice_sizes)),
    )


def gather_bmm_shrink(
    x: torch.Tensor,  # [T, K]
    a: torch.Tensor,  # [num_slots, S, R, K]
    token_slots: torch.Tensor,  # [T] int32
) -> torch.Tensor:  # [S, T, R] float32
    """The shrink as plain PyTorch would batch it: gather each token's A, one batched GEMV (in x's dtype)."""
    num_tokens = x.shape[0]
    _, num_slices, rank, k = a.shape
    keep = (token_slots >= 0).view(-1, 1)
    a_tok = a.index_select(0, token_slots.clamp(min=0)).view(num_tokens, num_slices * rank, k)
    v = torch.bmm(a_tok, x.unsqueeze(2)).view(num_tokens, num_slices * rank) * keep
    return v.view(num_tokens, num_slices, rank).transpose(0, 1).float()


def gather_bmm_expand(
    v: torch.Tensor,  # [S, T, R] float32
    b: torch.Tensor,  # [num_slots, N, R]
    token_slots: torch.Tensor,  # [T] int32
    y: torch.Tensor,  # [T, N], added to in place
    slice_starts: tuple[int, ...],
) -> None:
    """The expand as plain PyTorch would batch it: gather each token's B, one batched GEMV a slice."""
    keep = (token_slots >= 0).view(-1, 1)
    b_tok = b.index_select(0, token_slots.clamp(min=0))  # [T, N, R]
    for s, (lo, hi) in enumerate(itertools.pairwise(slice_starts)):
        delta = torch.bmm(b_tok[:, lo:hi], v[s].to(b.dtype).unsqueeze(2)).squeeze(2)
        y[:, lo:hi] += delta * keep
