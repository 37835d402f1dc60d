"""Every Triton kernel compiles for sm_90 (H100/H200) with the arguments its wrapper launches it with,
on this GPU-less machine: the compiler refuses programs the interpreter runs
(tests/kernels/compile_for_gpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from triton.runtime.jit import JITFunction

SCRIPT = Path(__file__).parent / "kernels" / "compile_for_gpu.py"


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path / "triton"), "PYTHONSAFEPATH": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=900
    )


def test_every_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    proc = _run(tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ok ", "FAIL "))]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    kernels = {line.split(": ")[1].split(" ")[0] for line in lines}
    assert len(lines) >= 20 and not any(line.startswith("FAIL") for line in lines)
    core = {"_rotary_kernel", "_rms_norm_kernel", "_decode_kernel", "_prefill_kernel", "_merge_kernel"}
    assert core <= kernels, kernels
    assert {
        "_bgmv_shrink_kernel",
        "_bgmv_expand_kernel",
        "_sgmv_shrink_kernel",
        "_sgmv_expand_kernel",
    } <= kernels
    # DecodeConfig.maxnreg (swept by `bench kernels --sweep fp8`) reaches the compiler as a cap.
    assert any(
        line.startswith("ok   attention decode fp8 V token-major, maxnreg 80: _decode_kernel (")
        and ", maxnreg 80" in line.split(": ", 1)[1]
        for line in lines
    ), lines
    # With programmatic dependent launch on (the default on Hopper), the hot path's kernels launch early,
    # each waiting for its inputs first (compile_for_gpu fails a launch whose PTX has no wait).
    early = {line.split(": ")[1].split(" ")[0] for line in lines if line.endswith(", PDL)")}
    assert early == core | {
        "_reduce_kernel",
        "_write_kv_kernel",
        "_silu_and_mul_kernel",
        "_silu_and_mul_quant_kernel",
        "_silu_mul_tile_amax_kernel",
        "_silu_mul_tile_quant_kernel",
        "_quantize_fp8_rows_kernel",
        "_scale_product_kernel",
        "_chunk_max_kernel",
        "_pick_kernel",
        "_seeded_noise_kernel",
    }, early


def test_fp8_decode_widens_v_before_shared_memory(tmp_path: Path) -> None:
    """Over an fp8 cache the decode kernel widens V by inline PTX in the load's layout, so the dot reads
    it as float16 (`ldmatrix.trans`), never a byte at a time: the byte-wise reads are what held V at
    about half the speed of K on an H200 (kernels/attention.py, `_widen_fp8`)."""
    proc = _run(tmp_path, "--fp8-decode-ptx")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["v"]["ld.shared.b8"] == 0 and counts["v"]["ldmatrix trans"] > 0, counts
    # A token-major V (the engine's fp8 layout) is cast like K, and both reach shared memory in 16-byte
    # copies: its runs of slots must stay vectorized, never byte loads or narrower copies.
    tm = counts["token-major"]
    assert tm["ld.shared.b8"] == 0 and tm["ld.global byte"] == 0 and tm["cp.async narrower"] == 0, counts
    assert tm["cp.async 16-byte"] >= counts["v"]["cp.async 16-byte"] > 0, counts


def test_arguments_that_change_step_to_step_are_not_specialized() -> None:
    """Triton compiles a kernel again for each new combination of its integer arguments being 1 or a
    multiple of 16; one first met in a served step compiles inside it (a reduce variant stalled a step
    67 ms on an H100, BENCHMARKS.md 2026-12-07). Arguments that change step to step and only bound or
    offset are left unspecialized; the decode path's split count stays specialized, its variants
    compiled by the warm-up (`compile_decode_variants`)."""
    from pagoda.kernels import attention, lse_merge

    def unspecialized(fn: JITFunction) -> set[str]:
        return {p.name for p in fn.params if p.do_not_specialize}

    assert unspecialized(attention._decode_kernel) == {"stride_bt"}
    assert unspecialized(attention._prefill_kernel) == {"num_seqs", "stride_bt"}
    assert unspecialized(lse_merge._merge_kernel) == {"num_tokens"}
    assert unspecialized(attention._reduce_kernel) == set()
