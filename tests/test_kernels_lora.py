"""Multi-LoRA's PyTorch references (`reference.lora_shrink` / `lora_expand`, the spec the Triton kernels are
held to and the engine's CPU path) against the definition written out a token and a slice at a time, and
the package's dispatch on CPU tensors. The Triton kernels themselves: tests/kernels/check_lora.py, run in
the interpreter by tests/test_kernels_interpret.py."""

from __future__ import annotations

import pytest
import torch

import pagoda.kernels as kernels
from pagoda.bench.lora_inputs import LoraInputs, lora_inputs
from pagoda.kernels import reference

SLICES = (6, 3, 3)  # q, k, v of unequal sizes


def _inputs(dtype: torch.dtype = torch.float32) -> LoraInputs:
    gen = torch.Generator().manual_seed(0)
    # Slot 3 is never used, slot 0 has two runs, slot 2 has rank 1 of R = 4.
    return lora_inputs([1, 4, 2, 3], [2, 0, -1, 0], 5, SLICES, [4, 4, 1, 4], dtype, "cpu", gen)


def test_shrink_is_each_tokens_slot_times_x() -> None:
    inp = _inputs()
    v = reference.lora_shrink(inp.x, inp.a, inp.token_slots)
    assert v.dtype == torch.float32 and v.shape == (3, 10, 4)
    for t, slot in enumerate(inp.token_slots.tolist()):
        for s in range(3):
            expected = inp.a[slot, s].double() @ inp.x[t].double() if slot >= 0 else torch.zeros(4)
            torch.testing.assert_close(v[s, t], expected.float(), atol=1e-6, rtol=1e-5)
    assert not v[:, 0, 1:].any(), "token 0 has slot 2, whose adapter has rank 1 of 4"


def test_expand_adds_each_slices_product_to_its_columns() -> None:
    inp = _inputs()
    v = torch.randn(3, 10, 4)
    y = inp.y.clone()
    reference.lora_expand(v, inp.b, inp.token_slots, y, inp.slice_starts)
    expected = inp.y.clone()
    for t, slot in enumerate(inp.token_slots.tolist()):
        if slot < 0:
            continue
        for s, (lo, hi) in enumerate([(0, 6), (6, 9), (9, 12)]):
            for n in range(lo, hi):
                expected[t, n] += sum(float(v[s, t, r]) * float(inp.b[slot, n, r]) for r in range(4))
    torch.testing.assert_close(y, expected, atol=1e-6, rtol=1e-5)
    assert torch.equal(y[5:7], inp.y[5:7]), "the run of slot -1 keeps its bits"


def test_expand_rounds_the_float32_sum_once_to_ys_dtype() -> None:
    inp = _inputs(torch.bfloat16)
    v = reference.lora_shrink(inp.x, inp.a, inp.token_slots)
    y = inp.y.clone()
    reference.lora_expand(v, inp.b, inp.token_slots, y, inp.slice_starts)
    delta = torch.zeros(10, 12)
    for t, slot in enumerate(inp.token_slots.tolist()):
        if slot >= 0:
            parts = [
                v[s, t] @ inp.b[slot, lo:hi].float().t()
                for s, (lo, hi) in enumerate([(0, 6), (6, 9), (9, 12)])
            ]
            delta[t] = torch.cat(parts)
    keep = (inp.token_slots >= 0).view(-1, 1)
    assert torch.equal(y, torch.where(keep, (inp.y.float() + delta).bfloat16(), inp.y))


def test_cpu_tensors_run_the_references(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the package's functions are the references, whichever form `segments` asks for."""
    monkeypatch.delenv("PAGODA_KERNELS", raising=False)
    inp = _inputs(torch.float32)
    v_ref = reference.lora_shrink(inp.x, inp.a, inp.token_slots)
    y_ref = inp.y.clone()
    reference.lora_expand(v_ref, inp.b, inp.token_slots, y_ref, inp.slice_starts)
    for segments in (None, inp.segments):
        v = kernels.lora_shrink(inp.x, inp.a, inp.token_slots, segments)
        assert torch.equal(v, v_ref)
        y = inp.y.clone()
        kernels.lora_expand(v, inp.b, inp.token_slots, y, inp.slice_starts, segments)
        assert torch.equal(y, y_ref)


def test_segments_describe_the_token_slots() -> None:
    inp = _inputs()
    assert inp.segments.starts.tolist() == [0, 1, 5, 7, 10] and inp.segments.max_len == 4
    assert inp.token_slots.tolist() == [2, 0, 0, 0, 0, -1, -1, 0, 0, 0]
    assert inp.slice_starts == (0, 6, 9, 12)
