"""lora_shrink and lora_expand (kernels/lora.py), BGMV and SGMV, against `reference.py`.

Run under TRITON_INTERPRET=1 (tests/test_kernels_interpret.py does) on tiny shapes, or on a GPU, where
Llama-3-8B's shapes join them: K 4096, qkv's 4096 + 1024 + 1024 and gate_up's 14336 + 14336 output
columns, 1, 64 and 512 tokens, R 16 and 64, 8 slots (bench/gpu_checks.sh runs this file).

Each step mixes slots: adapters of ranks below R (zero-padded), a run of one token, runs longer than a
tile, tokens without an adapter (slot -1) and slots that no token uses. BGMV takes the tokens' slots
shuffled (a decode batch), SGMV the runs. Tolerances: v (float32) 1e-5 in the interpreter, 1e-4 at
K = 4096 on the GPU (the float32 sums' order); y one rounding step of its dtype, as the other kernels'
checks (the kernels add a float32 sum to y and round once, as the reference; on the GPU the expand's
TF32 dot keeps 11 bits of v). Rows of slot -1 must keep y's bits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from pagoda.kernels import LoraSegments, reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA GPU", allow_module_level=True)

import pagoda.kernels as kernels  # noqa: E402
from pagoda.bench.lora_inputs import LoraInputs, lora_inputs  # noqa: E402
from pagoda.kernels import lora  # noqa: E402
from pagoda.kernels.lora import lora_expand, lora_shrink  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
V_TOL = 1e-5 if INTERPRET else 1e-4
FORMS = ["bgmv", "sgmv"]


@dataclass(frozen=True)
class Case:
    name: str
    k: int
    slices: tuple[int, ...]  # output columns of each slice
    ranks: list[int]  # each slot's adapter rank; R is the largest
    run_lens: list[int]
    run_slots: list[int]


# Tiny: K and the slices off the interpreter's 16-wide tiles (masks), a run of 19 over two 16-token tiles.
# Slot 3 is never used; slot 0 has two runs.
RUNS = dict(run_lens=[1, 19, 3, 2, 6], run_slots=[2, 0, -1, 1, 0])
SMALL = [
    Case("o S=1 R=8", 40, (24,), [8, 4, 1, 8], **RUNS),
    Case("qkv S=3 R=16", 40, (32, 16, 16), [16, 8, 3, 16], **RUNS),
    Case("gate_up S=2 R=12", 24, (20, 20), [12, 12, 5, 2], **RUNS),
]
CASES = [(SMALL[0], d) for d in TOL] + [(SMALL[1], d) for d in TOL] + [(SMALL[2], torch.float32)]
if not INTERPRET:
    LLAMA_8B = {"qkv": (4096, 1024, 1024), "gate_up": (14336, 14336)}
    STEPS = {  # tokens: (run lengths, run slots); the GPU's tile is 64 tokens
        1: ([1], [3]),
        64: ([1, 20, 7, 36], [5, -1, 2, 0]),
        512: ([1, 130, 64, 17, 300], [7, 1, -1, 6, 2]),
    }
    CASES += [
        (
            Case(f"{proj} R={r} T={t}", 4096, slices, [r, r, r // 2, r, 8, r, r // 4, r], *STEPS[t]),
            torch.bfloat16,
        )
        for proj, slices in LLAMA_8B.items()
        for r in (16, 64)
        for t in STEPS
    ]


def inputs(case: Case, dtype: torch.dtype, form: str) -> LoraInputs:
    gen = torch.Generator().manual_seed(0)
    inp = lora_inputs(case.run_lens, case.run_slots, case.k, case.slices, case.ranks, dtype, DEVICE, gen)
    if form == "bgmv":  # a decode batch: the same slots, in no order
        order = torch.randperm(inp.token_slots.shape[0], generator=gen).to(DEVICE)
        inp.token_slots = inp.token_slots[order]
    return inp


def segments_of(inp: LoraInputs, form: str) -> LoraSegments | None:
    return inp.segments if form == "sgmv" else None


def expected_y(inp: LoraInputs, v: torch.Tensor) -> torch.Tensor:
    y = inp.y.clone()
    reference.lora_expand(v, inp.b, inp.token_slots, y, inp.slice_starts)
    return y


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    ("case", "dtype"), CASES, ids=lambda p: p.name if isinstance(p, Case) else str(p)[6:]
)
def test_lora_matches_reference(case: Case, dtype: torch.dtype, form: str) -> None:
    inp = inputs(case, dtype, form)
    segments = segments_of(inp, form)
    v = lora_shrink(inp.x, inp.a, inp.token_slots, segments)
    v_ref = reference.lora_shrink(inp.x, inp.a, inp.token_slots)
    assert v.shape == v_ref.shape and v.dtype == torch.float32
    torch.testing.assert_close(v, v_ref, atol=V_TOL, rtol=V_TOL)
    none = inp.token_slots < 0
    assert not v[:, none].any(), "tokens without an adapter have zero rows"

    y = inp.y.clone()
    lora_expand(v_ref, inp.b, inp.token_slots, y, inp.slice_starts, segments)
    torch.testing.assert_close(y, expected_y(inp, v_ref), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(y[none], inp.y[none]), "rows of slot -1 keep their bits"


class _Spy:
    """A kernel whose launches are recorded (grid), then run."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        self.grids.append(grid)
        return self.fn[grid]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("split", [False, True], ids=["whole K", "split K"])
def test_shrink_over_whole_or_split_k(form: str, split: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """One program over all of K (stores), or K split over programs (float32 atomic adds into the zeroed v):
    the decode of a few tokens splits on the GPU."""
    inp = inputs(Case("split", 300, (16, 16), [16, 16, 4], [2, 1, 2], [1, -1, 0]), torch.float32, form)
    name = f"_{form}_shrink_kernel"
    spy = _Spy(getattr(lora, name))
    monkeypatch.setattr(lora, name, spy)
    cfg = replace(lora._config(None, inp.x.device), programs_per_sm=1000 if split else 0)
    v = lora_shrink(inp.x, inp.a, inp.token_slots, segments_of(inp, form), config=cfg)
    assert (spy.grids[0][1] > 1) is split, spy.grids
    torch.testing.assert_close(
        v, reference.lora_shrink(inp.x, inp.a, inp.token_slots), atol=V_TOL, rtol=V_TOL
    )
    assert not v[:, inp.token_slots < 0].any()


@pytest.mark.parametrize("form", FORMS)
def test_strided_activations_and_output(form: str) -> None:
    """x and y as column ranges of wider tensors (a fused projection's output): the columns beside them
    are not touched; each expand adds to what y holds."""
    inp = inputs(SMALL[1], torch.float16, form)
    num_tokens, k = inp.x.shape
    n = inp.y.shape[1]
    wide_x = torch.randn(num_tokens, k + 24, device=DEVICE).to(torch.float16)
    wide_x[:, 8 : 8 + k] = inp.x
    wide_y = torch.randn(num_tokens, n + 8, device=DEVICE).to(torch.float16)
    wide_y[:, :n] = inp.y
    before = wide_y.clone()
    segments = segments_of(inp, form)
    v = lora_shrink(wide_x[:, 8 : 8 + k], inp.a, inp.token_slots, segments)
    torch.testing.assert_close(
        v, reference.lora_shrink(inp.x, inp.a, inp.token_slots), atol=V_TOL, rtol=V_TOL
    )
    lora_expand(v, inp.b, inp.token_slots, wide_y[:, :n], inp.slice_starts, segments)
    lora_expand(v, inp.b, inp.token_slots, wide_y[:, :n], inp.slice_starts, segments)
    twice = expected_y(inp, v)
    reference.lora_expand(v, inp.b, inp.token_slots, twice, inp.slice_starts)
    torch.testing.assert_close(wide_y[:, :n], twice, atol=2e-3, rtol=2e-3)
    assert torch.equal(wide_y[:, n:], before[:, n:])


def test_bgmv_replays_in_a_cuda_graph() -> None:
    """Decode's form as the engine runs it: the step's tensors stay, their values change (new slots, a
    padded row of -1). On the GPU shrink and expand are captured in a CUDA graph and replayed (no host
    sync, a grid from shapes alone); the interpreter runs the same calls eagerly."""
    inp = inputs(SMALL[1], torch.float32, "bgmv")
    y = inp.y.clone()
    v_out = torch.zeros(1)

    def step() -> None:
        nonlocal v_out
        y.copy_(inp.y)
        v_out = lora_shrink(inp.x, inp.a, inp.token_slots)
        lora_expand(v_out, inp.b, inp.token_slots, y, inp.slice_starts)

    step()  # compiles (outside the capture)
    graph = None
    if not INTERPRET:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    num_tokens = inp.x.shape[0]
    mixed = [3 if t % 3 else 1 for t in range(num_tokens)]  # slot 3: unused by the captured step
    mixed[-1] = -1  # a padded row
    for slots in mixed, [-1] * num_tokens:
        inp.token_slots.copy_(torch.tensor(slots, dtype=torch.int32))
        inp.x.copy_(torch.randn_like(inp.x))
        if graph is None:
            step()
        else:
            graph.replay()
        v_ref = reference.lora_shrink(inp.x, inp.a, inp.token_slots)
        torch.testing.assert_close(v_out, v_ref, atol=V_TOL, rtol=V_TOL)
        torch.testing.assert_close(y, expected_y(inp, v_ref), atol=1e-5, rtol=1e-5)


def test_no_tokens_and_no_runs() -> None:
    x = torch.zeros(0, 32, device=DEVICE)
    a = torch.zeros(2, 3, 16, 32, device=DEVICE)
    none = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    empty = LoraSegments(torch.zeros(1, dtype=torch.int32, device=DEVICE), none, 0)
    for segments in (None, empty):
        v = lora_shrink(x, a, none, segments)
        assert v.shape == (3, 0, 16)
        lora_expand(v, torch.zeros(2, 48, 16, device=DEVICE), none, torch.zeros(0, 48, device=DEVICE),
                    (0, 16, 32, 48), segments)  # fmt: skip


def test_package_dispatch_runs_the_kernels() -> None:
    inp = inputs(SMALL[1], torch.float32, "sgmv")
    assert kernels.use_triton(inp.x)
    v = kernels.lora_shrink(inp.x, inp.a, inp.token_slots, inp.segments)
    torch.testing.assert_close(
        v, reference.lora_shrink(inp.x, inp.a, inp.token_slots), atol=V_TOL, rtol=V_TOL
    )
    y = inp.y.clone()
    kernels.lora_expand(v, inp.b, inp.token_slots, y, inp.slice_starts, inp.segments)
    torch.testing.assert_close(y, expected_y(inp, v), atol=1e-5, rtol=1e-5)


def test_refuses_bad_inputs() -> None:
    inp = inputs(SMALL[1], torch.float32, "sgmv")
    x, a, b, slots, starts = inp.x, inp.a, inp.b, inp.token_slots, inp.slice_starts
    v = reference.lora_shrink(x, a, slots)
    with pytest.raises(ValueError, match="share a dtype"):
        lora_shrink(x.half(), a, slots)
    with pytest.raises(ValueError, match="a \\[num_slots, S, R, K\\]"):
        lora_shrink(x, a[..., :-1], slots)
    with pytest.raises(ValueError, match="token_slots must be int32"):
        lora_shrink(x, a, slots.long())
    with pytest.raises(ValueError, match="one device"):
        lora_shrink(x, a, slots.to("meta"))
    with pytest.raises(ValueError, match="segments want"):
        lora_shrink(x, a, slots, LoraSegments(inp.segments.starts[:-1], inp.segments.slots, 19))
    with pytest.raises(ValueError, match="slice_starts"):
        lora_expand(v, b, slots, inp.y.clone(), (0, 32, 48, 60))
    with pytest.raises(ValueError, match="slice_starts"):
        lora_expand(v, b, slots, inp.y.clone(), (0, 64))
    with pytest.raises(ValueError, match="v float32"):
        lora_expand(v.half(), b, slots, inp.y.clone(), starts)
    with pytest.raises(ValueError, match="contiguous"):
        lora_expand(v, b, slots, inp.y.clone().t().contiguous().t(), starts)
