"""fp8 projection benchmark at Llama-3-8B shapes: every way to run `Fp8Linear` against bf16, per row count.

    python -m pagoda.bench.kernels_fp8 [--quick] [--sweep] [--activation] [--gemm-kernels] [--markdown PATH]

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
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
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
        "--fast-accum",
        action="store_true",
        help="only time _scaled_mm with and without use_fast_accum (default rows 1 256 640 8192)",
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


def _time(fn: Callable[[], object]) -> float:
    """`bench._time` with shorter replays: median us of CUDA-graph replays, eager if capture fails."""
    import torch
    import triton

    try:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median")
    except Exception:
        torch.cuda.synchronize()
        return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=REP_MS, return_mode="median")


def _cell(fn: Callable[[], object] | None) -> float | str:
    """Microseconds, or the error's first words (a method that fails must not stop the others)."""
    if fn is None:
        return math.nan
    try:
        fn()  # compile and check it runs before timing
        return _time(fn)
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


def _fast_accum_cells(m: int, n: int, k: int) -> tuple[list[float | str], list[float]]:
    """us of per-tensor and row-wise `_scaled_mm`, fast accumulation off then on, and each's error."""
    import torch

    from pagoda.kernels import reference

    one, bf16 = torch.ones((), device=DEVICE), torch.bfloat16
    xq, x_scale = reference.quantize_fp8_rows(torch.randn(m, k, device=DEVICE, dtype=bf16))
    weights = _Weights(n, k)

    def mm(fast: bool, rowwise: bool) -> Callable[[], object]:
        def call() -> object:
            wq, w_scale = weights.next_fp8()
            a, b = (x_scale, w_scale) if rowwise else (one, one)
            return torch._scaled_mm(xq, wq.t(), scale_a=a, scale_b=b, out_dtype=bf16, use_fast_accum=fast)

        return call

    cells = [_cell(mm(fast, rowwise)) for rowwise in (False, True) for fast in (False, True)]
    wq, w_scale = weights.fp8[0]
    exact = (xq.float() * x_scale) @ (wq.float() * w_scale.view(-1, 1)).t()
    errors = []
    for fast in (False, True):
        got = torch._scaled_mm(
            xq, wq.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.float32, use_fast_accum=fast
        )
        errors.append(((got - exact).abs().max() / exact.abs().max()).item())
    return cells, errors


def fast_accum(rows: tuple[int, ...]) -> list[str]:
    """Per row count and projection: us of `_scaled_mm` per-tensor (the unit-scale path) and row-wise,
    each with `use_fast_accum` off (the engine's) and on: Hopper's fp8 tensor cores then accumulate without
    promoting partial sums to float32. The error columns: the largest |product - exact| over the largest
    |exact| of the row-wise product (float32 out), against a float32 product of the same codes."""
    import torch

    lines = [
        "fp8 GEMMs with and without fast accumulation (us of CUDA-graph replay, TFLOP/s)",
        "",
        "| rows | projection | per-tensor | per-tensor, fast | row-wise | row-wise, fast | error | fast's |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for m in rows:
        for name, (n, k) in SHAPES.items():
            cells, errors = _fast_accum_cells(m, n, k)
            timed = " | ".join(_fmt(c, n * k, 2 * m * n * k) for c in cells)
            lines.append(f"| {m} | {name} | {timed} | {errors[0]:.1e} | {errors[1]:.1e} |")
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    return lines


def _write(lines: list[str], markdown: str | None) -> int:
    """Write the tables to `--markdown`'s file, if given; the run's exit status."""
    if markdown:
        with open(markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


def run(args: argparse.Namespace) -> int:
    import torch
    import triton

    if not torch.cuda.is_available():
        print("pagoda.bench.kernels_fp8: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    header = (
        f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; "
        "us of CUDA-graph replay (weight-read GB/s: bf16 2 bytes, fp8 1 byte a weight)"
    )
    print(header, flush=True)
    if args.gemm_kernels:
        return _write([header, "", *gemm_kernels(tuple(args.rows or (1, 64, 256)))], args.markdown)
    if args.fast_accum:
        return _write([header, "", *fast_accum(tuple(args.rows or (1, 256, 640, 8192)))], args.markdown)
    if args.activation:
        return _write([header, "", *activation_table()], args.markdown)
    out = [header, "", *checks()]
    print("\n".join(out[2:]), flush=True)
    table, per_layer = bench(tuple(args.rows or (QUICK_ROWS if args.quick else ROWS)))
    steps = step_table(per_layer)
    print("\n" + "\n".join(steps), flush=True)
    out += ["", *table, "", *steps]
    if args.sweep:
        out += ["", *sweep()]
    return _write(out, args.markdown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagoda.bench.kernels_fp8", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
