"""`python -m pagoda.bench.kernels` parses its arguments and refuses a machine without a GPU; its
tables and sweeps run on the GPU machine only (the kernels they time are checked in tests/kernels/)."""

from __future__ import annotations

import pytest
import torch

from pagoda.bench import kernels as bench


def test_help_lists_the_sweeps(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "--sweep-only" in out and "fp8" in out
    with pytest.raises(SystemExit):
        bench.main(["--sweep", "tiles"])  # not a sweep
    with pytest.raises(SystemExit):
        bench.main(["--only", "gemm"])  # not a section


def test_needs_a_gpu(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--sweep", "fp8", "--sweep-only"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_pagoda_bench_kernels_takes_the_same_options(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pagoda bench kernels --quick --only lora` reaches the kernels' own options (an argparse
    REMAINDER under a subcommand dropped leading options: "unrecognized arguments: --quick --only")."""
    from pagoda.bench import offline

    seen: list[object] = []
    monkeypatch.setattr(bench, "run", lambda args: seen.append(args) or 0)
    assert offline.main(["kernels", "--quick", "--only", "lora", "--markdown", "t.md"]) == 0
    args = seen[0]
    assert args.quick and args.only == ["lora"] and args.markdown == "t.md" and args.sweep == []
    with pytest.raises(SystemExit):
        offline.main(["kernels", "--only", "gemm"])
    assert "invalid choice" in capsys.readouterr().err


def test_lora_peer_computes_what_the_kernels_do() -> None:
    """The LoRA rows' gather + bmm peer computes the references' products (else the ratio would compare
    unlike work): every slice, slot -1 left alone, y added to."""
    from pagoda.bench.lora_inputs import gather_bmm_expand, gather_bmm_shrink, lora_inputs
    from pagoda.kernels import reference

    gen = torch.Generator().manual_seed(0)
    inp = lora_inputs([1, 3, 2, 2], [2, -1, 0, 2], 24, (8, 4, 4), [4, 2, 4], torch.float32, "cpu", gen)
    v = gather_bmm_shrink(inp.x, inp.a, inp.token_slots)
    torch.testing.assert_close(v, reference.lora_shrink(inp.x, inp.a, inp.token_slots))
    y, y_ref = inp.y.clone(), inp.y.clone()
    gather_bmm_expand(v, inp.b, inp.token_slots, y, inp.slice_starts)
    reference.lora_expand(v, inp.b, inp.token_slots, y_ref, inp.slice_starts)
    torch.testing.assert_close(y, y_ref)
    assert torch.equal(y[1:4], inp.y[1:4])


def test_causal_chunk_flops_counts_each_query_against_the_keys_up_to_its_own() -> None:
    """The long-prefill sweep's TFLOP/s: 2 queries last in a 4-token context see 3 and 4 keys."""
    per_key = 4 * bench.HEADS * bench.HEAD_DIM
    assert bench.causal_chunk_flops(2, 4) == 7 * per_key
    assert bench.causal_chunk_flops(4, 4) == 10 * per_key  # a whole prompt: 1 + 2 + 3 + 4
    with pytest.raises(SystemExit):
        bench.main(["--sweep", "long"])  # the sweep is "long-prefill"
