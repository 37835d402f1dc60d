"""fp8 projection benchmark at Llama-3-8B shapes: every way to run `Fp8Linear` against bf16, per row count.

    python -m pagoda.kernels.bench_fp8 [--quick] [--sweep] [--activation] [--gemm-kernels] [--gemv]
                                       [--markdown PATH]

For M in 1..256 rows and the four projections of a decoder layer (qkv 4096->6144, o 4096->4096,
gate_up 4096->28672, down 14336->4096) it times, in microseconds of CUDA-graph replay (the engine's
decode steps replay graphs), each call on the next of copies of the weights that overflow L2:

- bf16: `x @ w.t()`, the unquantized model;
- torch quant + mm: `Fp8Linear`'s W8A8 before the Triton quantization (five PyTorch ops per call)
  then `torch._scaled_mm` with row-wise scales;
- triton quant + mm: `kernels/quant.py` then the same `_scaled_mm`;
- skinny W8A16: `kernels/fp8_gemm.py` (M <= 64; it reads the weights once per 16 rows);
- mm per-tensor: `_scaled_mm` alone on activations quantized beforehand, with one scale per
  tensor, the fastest fp8 GEMM cuBLAS has (a bound, not a candidate: no per-row scales).

Each cell also gives the weight-read bandwidth (the weight's bytes over the time, GB/s). A second
table sums a decode step's projections (32 layers x 4) per method: the number `SKINNY_MAX_M` in
`service/model/fp8.py` is set from, where the skinny column stops winning. `--sweep` times tile
variants of the skinny kernel at 1 and 16 rows. Needs only torch and triton; runs in about a minute
and a half on an H200 (`--quick`: M 1, 16, 256). A method that fails prints its error in its cell.

`--gemm-kernels` lists, per row count and projection, the unit-scale `_scaled_mm` the engine's decode
steps run: its time, and the kernels and memsets cuBLASLt launches for it (a dynamically scheduled
kernel zeroes a counter with a memset first, a graph node of its own). cuBLASLt's workspace size is
read once per process (`CUBLASLT_WORKSPACE_SIZE`, KiB): run it under each setting to compare.

`--gemv` times `fp8_gemm.fp8_gemv` (no tensor cores, for 1-8 rows) against the unit-scale `_scaled_mm`
the engine runs and bf16, per row count (1, 2, 4, 8) and projection: a sweep of its tiles at 1 row
(tiles x warps, then the best three's pipeline depths, then the best two's split-K), the five best of
those at 2, 4 and 8 rows, and down_proj with the SiLU-and-mul fused in (`silu_mul=True`) at its best
tile, against the two launches. Kernels compile in parallel processes ahead of each stage (Triton's
disk cache); about two to three minutes on an H200.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

HELP = "time the fp8 projection paths (quantize + _scaled_mm, skinny W8A16) against bf16 on this GPU"

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # N, K
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUICK_ROWS = (1, 16, 256)
SKINNY_ROWS = 64  # above, the skinny kernel re-reads the weights more than 4 times
NUM_LAYERS = 32
METHODS = ("bf16", "torch quant + mm", "triton quant + mm", "skinny W8A16", "mm per-tensor")
FP8_METHODS = METHODS[1:]
DEVICE = "cuda"
ROTATE_BYTES = 200e6  # 4x an H200's L2
REP_MS = 20  # graph replay per timing (bench.py's 50 would take this run past two minutes)
GEMV_ROWS = (1, 2, 4, 8)
GEMV_SWEEP_REP_MS = 5  # per candidate of the --gemv sweep; each best is timed again at REP_MS
GEMV_TOP = 5  # --gemv: the best tiles at 1 row that are timed at 2, 4 and 8 rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help=f"rows {QUICK_ROWS} only")
    parser.add_argument("--sweep", action="store_true", help="also time skinny kernel tile variants")
    parser.add_argument("--activation", action="store_true", help="time only the quantizing SiLU-and-mul")
    parser.add_argument(
        "--rows", type=int, nargs="+", help=f"these row counts instead of {ROWS} (prefill sizes: 4096)"
    )
    parser.add_argument(
        "--gemm-kernels",
        action="store_true",
        help="only list the unit-scale fp8 GEMMs' kernels and memsets by rows (default rows 1 64 256)",
    )
    parser.add_argument(
        "--gemv", action="store_true", help="only the fp8 GEMV for 1-8 rows against _scaled_mm and bf16"
    )
    parser.add_argument("--markdown", help="write the tables to this file")


class _Weights:
    """Copies of one projection's weights, handed out in turn: timing one weight in a loop would read
    it from the 50 MB L2 of an H200 (o_proj is 17 MB in fp8), where a model's 32 layers stream from
    HBM. The copies total ROTATE_BYTES per format."""

    def __init__(self, n: int, k: int) -> None:
        import torch

        from pagoda.kernels import reference

        self.bf16, self.fp8 = [], []
        for _ in range(math.ceil(ROTATE_BYTES / (n * k))):
            w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02
            wq, w_scale = reference.quantize_fp8_rows(w)
            self.bf16.append(w)
            self.fp8.append((wq, w_scale.view(1, -1)))
        self.i = 0

    def next_bf16(self) -> Any:
        self.i += 1
        return self.bf16[self.i % len(self.bf16)]

    def next_fp8(self) -> tuple[Any, Any]:
        self.i += 1
        return self.fp8[self.i % len(self.fp8)]


def _methods(m: int, n: int, k: int) -> dict[str, Callable[[], object] | None]:
    """The timed callables of one (rows, shape) cell; None where a method does not apply."""
    import torch

    from pagoda.kernels import reference
    from pagoda.kernels.fp8_gemm import fp8_matmul_w8a16
    from pagoda.kernels.quant import quantize_fp8_rows

    bf16 = torch.bfloat16
    x = torch.randn(m, k, device=DEVICE, dtype=bf16)
    xq, _ = reference.quantize_fp8_rows(x)
    one = torch.ones((), device=DEVICE)
    weights = _Weights(n, k)

    def torch_quant_mm() -> object:
        (wq, w_scale), (q, s) = weights.next_fp8(), reference.quantize_fp8_rows(x)
        return torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=w_scale, out_dtype=bf16)

    def triton_quant_mm() -> object:
        (wq, w_scale), (q, s) = weights.next_fp8(), quantize_fp8_rows(x)
        return torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=w_scale, out_dtype=bf16)

    def skinny() -> object:
        return fp8_matmul_w8a16(x, *weights.next_fp8())

    def per_tensor() -> object:
        return torch._scaled_mm(xq, weights.next_fp8()[0].t(), scale_a=one, scale_b=one, out_dtype=bf16)

    return {
        "bf16": lambda: x @ weights.next_bf16().t(),
        "torch quant + mm": torch_quant_mm,
        "triton quant + mm": triton_quant_mm,
        "skinny W8A16": skinny if m <= SKINNY_ROWS else None,
        "mm per-tensor": per_tensor,
    }


def _time(fn: Callable[[], object], rep_ms: int = REP_MS) -> float:
    """`bench._time` with shorter replays: median us of CUDA-graph replays, eager if capture fails."""
    import torch
    import triton

    try:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
    except Exception:
        torch.cuda.synchronize()
        return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")


def _cell(fn: Callable[[], object] | None, rep_ms: int = REP_MS) -> float | str:
    """Microseconds, or the error's first words (a method that fails must not stop the others)."""
    if fn is None:
        return math.nan
    try:
        fn()  # compile and check it runs before timing
        return _time(fn, rep_ms)
    except Exception as exc:
        first_line = str(exc).splitlines()[0][:80] if str(exc) else ""
        return f"error: {type(exc).__name__}: {first_line}"


def _fmt(us: float | str, weight_bytes: int, flops: int = 0) -> str:
    """us and the weight-read GB/s, or the TFLOP/s where `flops` is given (prefill sizes)."""
    if isinstance(us, str):
        return us.replace("|", "/")
    if math.isnan(us):
        return ""
    if flops:
        return f"{us:.1f} ({flops / (us * 1e6):.0f} TF)"
    return f"{us:.1f} ({weight_bytes / (us * 1e3):.0f})"


def checks() -> list[str]:
    """On this GPU: the Triton quantization against PyTorch's, the skinny kernel against float32."""
    import torch

    from pagoda.kernels import reference
    from pagoda.kernels.fp8_gemm import fp8_matmul_w8a16
    from pagoda.kernels.quant import quantize_fp8_rows

    lines = []
    try:
        x = torch.randn(64, 14336, device=DEVICE, dtype=torch.bfloat16) * 3
        q, s = quantize_fp8_rows(x)
        q_ref, s_ref = reference.quantize_fp8_rows(x)
        differ = (q.view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()
        scales_differ = int((s != s_ref).sum())
        lines.append(
            f"triton quantization == PyTorch's, 64 x 14336 bf16: {len(differ) == 0 and scales_differ == 0}"
            f" ({len(differ)} codes and {scales_differ} scales differ)"
        )
        for r, c in differ[:4].tolist():  # what differs, to tell a rounding rule from a sign of zero
            lines.append(
                f"  x {float(x[r, c]):.6g} / scale {float(s_ref[r, 0]):.6g}:"
                f" ours {float(q[r, c].float()):.6g}"
                f" (0x{int(q.view(torch.uint8)[r, c]):02x}), PyTorch {float(q_ref[r, c].float()):.6g}"
                f" (0x{int(q_ref.view(torch.uint8)[r, c]):02x})"
            )
        w, w_scale = reference.quantize_fp8_rows(torch.randn(4096, 14336, device=DEVICE) * 0.02)
        out = fp8_matmul_w8a16(x[:5], w, w_scale)
        ref = reference.fp8_matmul_w8a16(x[:5].float(), w, w_scale)
        err = float((out.float() - ref).norm() / ref.norm())
        lines.append(f"skinny W8A16 vs float32 reference, 5 x 14336 -> 4096: relative L2 {err:.1e}")
    except Exception as exc:
        lines.append(f"checks failed: {exc!r}")
    return lines


def bench(rows: tuple[int, ...]) -> tuple[list[str], dict[int, dict[str, float]]]:
    """The per-cell table's lines, and per rows x method the summed microseconds of one layer."""
    import torch

    lines = [
        "| M | projection | " + " | ".join(f"{m} us (GB/s)" for m in METHODS) + " |",
        "| ---: | --- |" + " ---: |" * len(METHODS),
    ]
    per_layer: dict[int, dict[str, float]] = {}
    for m in rows:
        sums = per_layer.setdefault(m, {})
        for name, (n, k) in SHAPES.items():
            try:
                fns = _methods(m, n, k)
            except Exception as exc:
                lines.append(f"| {m} | {name} | setup failed: {exc!r} |")
                continue
            cells = []
            for method, fn in fns.items():
                us = _cell(fn)
                cells.append(
                    _fmt(us, n * k * (2 if method == "bf16" else 1), 2 * m * n * k if m >= 512 else 0)
                )
                sums[method] = sums.get(method, 0.0) + (us if isinstance(us, float) else math.nan)
            lines.append(f"| {m} | {name} {k}->{n} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
            del fns
            torch.cuda.empty_cache()
    return lines, per_layer


def step_table(per_layer: dict[int, dict[str, float]]) -> list[str]:
    lines = [
        f"Per decode step, {NUM_LAYERS} layers x 4 projections (ms; the LM head and everything else not "
        "included; best fp8 marked *):",
        "",
        "| M | " + " | ".join(METHODS) + " |",
        "| ---: |" + " ---: |" * len(METHODS),
    ]
    for m, sums in per_layer.items():
        ms = {k: NUM_LAYERS * v / 1e3 for k, v in sums.items()}
        fp8 = {k: v for k, v in ms.items() if k in FP8_METHODS[:3] and not math.isnan(v)}
        best = min(fp8, key=fp8.__getitem__) if fp8 else None
        cells = [
            "" if math.isnan(ms.get(k, math.nan)) else f"{ms[k]:.2f}{'*' if k == best else ''}"
            for k in METHODS
        ]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def sweep() -> list[str]:
    """Skinny kernel tiles at 1 and 16 rows, each projection (us)."""
    import torch

    from pagoda.kernels.fp8_gemm import Fp8GemmConfig, fp8_matmul_w8a16

    configs = [Fp8GemmConfig()] + [
        Fp8GemmConfig(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
        for bn, bk, nw, ns in [
            (16, 128, 4, 4), (16, 512, 4, 3), (16, 512, 8, 3), (16, 256, 4, 6), (16, 1024, 8, 2),
            (32, 256, 4, 4), (32, 512, 8, 3), (64, 256, 8, 3), (16, 256, 2, 4),
        ]
    ]  # fmt: skip
    lines = ["skinny W8A16 tiles (us at M = 1 | 16 per projection; the default first):"]
    weights = {name: _Weights(n, k) for name, (n, k) in SHAPES.items()}
    for cfg in configs:
        cells = []
        for name, w in weights.items():
            times = []
            for m in (1, 16):
                x = torch.randn(m, SHAPES[name][1], device=DEVICE, dtype=torch.bfloat16)
                us = _cell(lambda x=x, w=w, cfg=cfg: fp8_matmul_w8a16(x, *w.next_fp8(), config=cfg))
                times.append(us if isinstance(us, str) else f"{us:.1f}")
            cells.append(f"{name} {' | '.join(times)}")
        label = f"n {cfg.block_n} k {cfg.block_k} warps {cfg.num_warps} stages {cfg.num_stages}"
        lines.append(f"  {label}: " + "; ".join(cells))
        print(lines[-1], flush=True)
    return lines


def _activation_row(m: int, d: int) -> list[float | str]:
    """One row count's cells of `activation_table`: bf16 out, then per row / tiled, unscaled / scaled."""
    import torch

    from pagoda.kernels import activation

    copies = [
        torch.randn(m, 2 * d, device=DEVICE, dtype=torch.bfloat16) for _ in range(_num_copies(4 * m * d))
    ]
    row_scale = torch.rand(m, 1, device=DEVICE) * 1e-3
    col_scale = torch.rand(1, 2 * d, device=DEVICE) * 1e-2
    turn = [0]

    def nxt() -> Any:
        turn[0] += 1
        return copies[turn[0] % len(copies)]

    def call(tiled: bool | None, scaled: bool) -> Callable[[], object]:
        def fn() -> object:
            if tiled is None:
                return activation.silu_and_mul(nxt())
            activation.TILED_MAX_ROWS = activation.SCALED_TILED_MAX_ROWS = 1 << 30 if tiled else -1
            scales = (row_scale, col_scale) if scaled else None
            return activation.silu_and_mul(nxt(), quantize=True, scales=scales, scaled_dtype=torch.bfloat16)

        return fn

    defaults = activation.TILED_MAX_ROWS, activation.SCALED_TILED_MAX_ROWS
    try:
        return [_cell(call(None, False))] + [
            _cell(call(t, sc)) for sc in (False, True) for t in (False, True)
        ]
    finally:
        activation.TILED_MAX_ROWS, activation.SCALED_TILED_MAX_ROWS = defaults


def _num_copies(nbytes: int) -> int:
    return max(2, int(ROTATE_BYTES // nbytes))


def activation_table(d: int = 14336) -> list[str]:
    """The quantizing SiLU-and-mul (down_proj's input) per row count, one program per row against
    column tiles, unscaled (row-wise path) and applying the gate-up product's scales (unit-scale path);
    inputs rotate through copies that overflow L2, as a step's 32 layers do."""
    lines = [
        f"SiLU-and-mul quantized to fp8, d = {d}: us per call (input GB/s)",
        "",
        "| rows | bf16 out | per row | tiled | per row, scaled | tiled, scaled |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for m in (1, 4, 16, 64, 128, 256, 512):
        cells = _activation_row(m, d)
        lines.append(f"| {m} | " + " | ".join(_fmt(c, 4 * m * d) for c in cells) + " |")
        print(lines[-1], flush=True)
    return lines


def gemm_kernels(rows: tuple[int, ...]) -> list[str]:
    """Per row count and projection: us of a CUDA-graph replay of the unit-scale `_scaled_mm`, and the
    memsets and kernels cuBLASLt launches for it (one profiled call)."""
    import os

    import torch
    from torch.profiler import ProfilerActivity, profile

    workspace = os.environ.get("CUBLASLT_WORKSPACE_SIZE", "(default)")
    lines = [
        f"unit-scale fp8 GEMMs (one weight each: small ones replay from L2), workspace {workspace} KiB",
        "",
        "| rows | projection | us | memsets | kernels |",
        "| ---: | --- | ---: | ---: | --- |",
    ]
    one = torch.ones((), device=DEVICE)
    for m in rows:
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device=DEVICE).to(torch.float8_e4m3fn)
            w = (torch.randn(n, k, device=DEVICE) * 0.02).to(torch.float8_e4m3fn)

            def mm(x: Any = x, w: Any = w) -> object:
                return torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

            us = _cell(mm)
            if isinstance(us, str):  # the error, in its cell; the other projections still run
                lines.append(f"| {m} | {name} | {us.replace('|', '/')} | | |")
                print(lines[-1], flush=True)
                continue
            with profile(activities=[ProfilerActivity.CUDA]) as prof:  # (warm: _cell ran it)
                mm()
                torch.cuda.synchronize()
            names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            memsets = sum("memset" in n.lower() for n in names)
            kernels = ", ".join(n[:60] for n in names if "memset" not in n.lower())
            lines.append(f"| {m} | {name} | {us:.1f} | {memsets} | {kernels} |")
            print(lines[-1], flush=True)
    return lines


def gemv_configs() -> list[Any]:
    """The first stage of the --gemv sweep: tiles x warps, 3 stages, one launch. Skipped as absurd for
    this kernel: a tile over 32768 weights; under 4 K elements a thread and load (block_k < 128 x
    num_warps: the narrow loads skip cp.async, whatever num_stages says); under 8 or over 64 weight
    bytes a thread and iteration (too little in flight, or registers spilled at 8 rows)."""
    from pagoda.kernels.fp8_gemm import GemvConfig

    configs = []
    for block_n, block_k, num_warps in itertools.product((4, 8, 16, 32), (256, 512, 1024), (2, 4, 8)):
        per_thread = block_n * block_k // (32 * num_warps)
        if block_n * block_k <= 32768 and block_k >= 128 * num_warps and 8 <= per_thread <= 64:
            configs.append(GemvConfig(block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=3))
    return configs


def _us(us: float | str) -> str:
    return us.replace("|", "/") if isinstance(us, str) else f"{us:.1f}"


def _gbps(us: float | str, weight_bytes: int) -> str:
    return f"{weight_bytes / (us * 1e3):.0f}" if isinstance(us, float) and us > 0 else ""


def _gemv_label(cfg: Any) -> str:
    return f"n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} split{cfg.split_k}"


def _warm_gemv(job: tuple[int, Any, bool]) -> None:
    """Compile one (rows, config, silu_mul) of `fp8_gemv` for the GPU, with the specialization the
    timed shapes get (N, K and the strides multiples of 16, K of block_k, N of block_n)."""
    import torch

    from pagoda.kernels.fp8_gemm import fp8_gemv

    rows, cfg, silu_mul = job
    n, k = 256, 8192
    x = torch.zeros(rows, 2 * k if silu_mul else k, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.zeros(n, k, device=DEVICE, dtype=torch.float8_e4m3fn)
    fp8_gemv(x, weight, torch.ones(n, device=DEVICE), config=cfg, silu_mul=silu_mul)
    torch.cuda.synchronize()


def _precompile(jobs: list[tuple[int, Any, bool]]) -> None:
    """Compile the next stage's kernels in parallel processes (about a second each on one core), so that
    this process finds them in Triton's disk cache; on any failure they compile when first timed."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from pagoda.kernels import bench_fp8  # by its module name: this file may be __main__

    jobs = list(dict.fromkeys(jobs))
    workers = min(len(jobs), os.cpu_count() or 1, 16)
    if workers < 2:
        return
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(bench_fp8._warm_gemv, jobs))
    except Exception as exc:
        print(f"  (parallel compilation failed, compiling as timed: {type(exc).__name__}: {exc})", flush=True)


def gemv_checks() -> list[str]:
    """On this GPU: fp8_gemv against the float32 reference, and its fused SiLU against the unfused path."""
    import torch

    from pagoda.kernels import activation, reference
    from pagoda.kernels.fp8_gemm import GemvConfig, fp8_gemv

    lines = []
    try:
        n, k = SHAPES["down"]
        w, w_scale = reference.quantize_fp8_rows(torch.randn(n, k, device=DEVICE) * 0.02)
        for rows, cfg in ((1, GemvConfig()), (3, GemvConfig(split_k=2)), (8, GemvConfig(block_n=4))):
            x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
            ref = reference.fp8_matmul_w8a16(x.float(), w, w_scale)
            err = float((fp8_gemv(x, w, w_scale, config=cfg).float() - ref).norm() / ref.norm())
            lines.append(
                f"fp8_gemv vs float32 reference, {rows} x {k} -> {n} ({_gemv_label(cfg)}): rel L2 {err:.1e}"
            )
        gate_up = torch.randn(2, 2 * k, device=DEVICE, dtype=torch.bfloat16) * 3
        fused = fp8_gemv(gate_up, w, w_scale, silu_mul=True)
        unfused = fp8_gemv(activation.silu_and_mul(gate_up), w, w_scale)
        lines.append(
            f"fp8_gemv silu_mul == silu_and_mul then fp8_gemv, 2 rows: {torch.equal(fused, unfused)}"
        )
    except Exception as exc:
        lines.append(f"gemv checks failed: {exc!r}")
    return lines


def gemv_tables() -> list[str]:
    """Per row count, a table of each projection: unit-scale `_scaled_mm`, bf16 `F.linear`, and the best
    `fp8_gemv` of a sweep (see the module docstring) with its config; then down_proj with its input's
    SiLU-and-mul fused, against `activation.silu_and_mul` and the GEMV as two launches."""
    import torch
    import torch.nn.functional as F

    from pagoda.kernels import activation, reference
    from pagoda.kernels.fp8_gemm import fp8_gemv

    bf16 = torch.bfloat16
    one = torch.ones((), device=DEVICE)
    weights = {name: _Weights(n, k) for name, (n, k) in SHAPES.items()}
    inputs = {
        (m, name): torch.randn(m, k, device=DEVICE, dtype=bf16)
        for m in GEMV_ROWS
        for name, (_, k) in SHAPES.items()
    }

    def gemv(m: int, name: str, cfg: Any) -> Callable[[], object]:
        x, w = inputs[(m, name)], weights[name]
        return lambda: fp8_gemv(x, *w.next_fp8(), config=cfg)

    def sweep(m: int, name: str, configs: list[Any], times: dict[Any, float]) -> None:
        for cfg in configs:
            if cfg not in times:
                us = _cell(gemv(m, name, cfg), GEMV_SWEEP_REP_MS)
                times[cfg] = us if isinstance(us, float) else math.inf
                if isinstance(us, str):
                    print(f"  rows {m} {name} {_gemv_label(cfg)}: {us}", flush=True)
        best = min(times, key=times.__getitem__)
        print(
            f"  rows {m} {name}: {len(times)} configs, best {times[best]:.1f} us {_gemv_label(best)}",
            flush=True,
        )

    def ranked(times: dict[Any, float]) -> list[Any]:
        return sorted((c for c in times if math.isfinite(times[c])), key=times.__getitem__)

    # Rows 1: tiles x warps, then the best three's pipeline depths, then the best two's split-K.
    sweeps: dict[tuple[int, str], dict[Any, float]] = {(1, name): {} for name in SHAPES}
    stage = gemv_configs()
    print(f"gemv sweep, rows 1: {len(stage)} tiles", flush=True)
    _precompile([(1, cfg, False) for cfg in stage])
    for name in SHAPES:
        sweep(1, name, stage, sweeps[(1, name)])
    for field, values, best_n in (("num_stages", (1, 2, 4), 3), ("split_k", (2, 4), 2)):
        stages = {
            name: [replace(c, **{field: v}) for c in ranked(sweeps[(1, name)])[:best_n] for v in values]
            for name in SHAPES
        }
        print(f"gemv sweep, rows 1: {field} {values} of the best {best_n}", flush=True)
        _precompile([(1, cfg, False) for cfgs in stages.values() for cfg in cfgs])
        for name in SHAPES:
            sweep(1, name, stages[name], sweeps[(1, name)])

    def table(m: int) -> list[str]:
        lines = [
            "",
            f"fp8 GEMV at {m} row(s): us (weight-read GB/s); gemv = `fp8_gemv`'s best config of the sweep",
            "",
            "| projection | _scaled_mm unit scales | bf16 F.linear | gemv us | gemv GB/s | gemv config |",
            "| --- | ---: | ---: | ---: | ---: | --- |",
        ]
        print("\n".join(lines), flush=True)
        sums = {"mm": 0.0, "bf16": 0.0, "gemv": 0.0}
        for name, (n, k) in SHAPES.items():
            x, w = inputs[(m, name)], weights[name]
            xq = reference.quantize_fp8_rows(x)[0]

            def unit_scale_mm(xq: Any = xq, w: _Weights = w) -> object:  # as Fp8Linear._unit_scale_product
                return torch._scaled_mm(xq, w.next_fp8()[0].t(), scale_a=one, scale_b=one, out_dtype=bf16)

            def linear(x: Any = x, w: _Weights = w) -> object:
                return F.linear(x, w.next_bf16())

            mm, lin = _cell(unit_scale_mm), _cell(linear)
            order = ranked(sweeps[(m, name)])
            best = order[0] if order else None
            us = _cell(gemv(m, name, best)) if best is not None else "error: no config ran"
            for key, val in (("mm", mm), ("bf16", lin), ("gemv", us)):
                sums[key] += val if isinstance(val, float) else math.nan
            label = _gemv_label(best) if best is not None else ""
            lines.append(
                f"| {name} {k}->{n} | {_fmt(mm, n * k)} | {_fmt(lin, 2 * n * k)} | {_us(us)} | "
                f"{_gbps(us, n * k)} | {label} |"
            )
            print(lines[-1], flush=True)
            if name == "down" and best is not None:
                gate_up = torch.randn(m, 2 * k, device=DEVICE, dtype=bf16)

                def fused(g: Any = gate_up, w: _Weights = w, cfg: Any = best) -> object:
                    return fp8_gemv(g, *w.next_fp8(), config=cfg, silu_mul=True)

                def apart(g: Any = gate_up, w: _Weights = w, cfg: Any = best) -> object:
                    return fp8_gemv(activation.silu_and_mul(g), *w.next_fp8(), config=cfg)

                us, us_apart = _cell(fused), _cell(apart)
                lines.append(
                    f"| down, SiLU-and-mul fused (silu_mul) | | | {_us(us)} | {_gbps(us, n * k)} | "
                    f"{label}; unfused (2 launches) {_us(us_apart)} us |"
                )
                print(lines[-1], flush=True)
        step = {key: f"{NUM_LAYERS * val / 1e3:.2f}" for key, val in sums.items()}
        lines += [
            "",
            f"Per decode step, {NUM_LAYERS} layers x 4 projections (ms): _scaled_mm {step['mm']}, "
            f"bf16 {step['bf16']}, gemv {step['gemv']}",
        ]
        print(lines[-1], flush=True)
        return lines

    lines = table(1)
    # Rows 2, 4, 8: the best at 1 row, and the best with half the columns (half the accumulators).
    candidates = {}
    for name in SHAPES:
        top = ranked(sweeps[(1, name)])[:GEMV_TOP]
        half = [replace(top[0], block_n=top[0].block_n // 2)] if top and top[0].block_n > 4 else []
        candidates[name] = list(dict.fromkeys(top + half))
    print(f"gemv sweep, rows {GEMV_ROWS[1:]}: up to {GEMV_TOP + 1} configs a projection", flush=True)
    _precompile(
        [(m, c, False) for m in GEMV_ROWS[1:] for cfgs in candidates.values() for c in cfgs]
        + [(m, c, True) for m in GEMV_ROWS[1:] for c in candidates["down"]]
    )
    for m in GEMV_ROWS[1:]:
        for name in SHAPES:
            sweeps[(m, name)] = {}
            sweep(m, name, candidates[name], sweeps[(m, name)])
        lines += table(m)
    return lines


def run(args: argparse.Namespace) -> int:
    import torch
    import triton

    if not torch.cuda.is_available():
        print("pagoda.kernels.bench_fp8: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    header = (
        f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; "
        "us of CUDA-graph replay (weight-read GB/s: bf16 2 bytes, fp8 1 byte a weight)"
    )
    print(header, flush=True)
    if args.gemm_kernels:
        out = [header, "", *gemm_kernels(tuple(args.rows or (1, 64, 256)))]
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write("\n".join(out) + "\n")
        return 0
    if args.gemv:
        checks_out = gemv_checks()
        print("\n".join(checks_out), flush=True)
        out = [header, "", *checks_out, *gemv_tables()]
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write("\n".join(out) + "\n")
        return 0
    if args.activation:
        out = [header, "", *activation_table()]
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write("\n".join(out) + "\n")
        return 0
    out = [header, "", *checks()]
    print("\n".join(out[2:]), flush=True)
    table, per_layer = bench(tuple(args.rows or (QUICK_ROWS if args.quick else ROWS)))
    steps = step_table(per_layer)
    print("\n" + "\n".join(steps), flush=True)
    out += ["", *table, "", *steps]
    if args.sweep:
        out += ["", *sweep()]
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(out) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagoda.kernels.bench_fp8", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
