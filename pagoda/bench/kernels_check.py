"""Every Triton kernel against its reference on the GPU, over many shapes, on fresh random inputs.

    python -m pagoda.bench.kernels_check [--quick] [--seed N]

The reference runs in float64 on the same (rounded) inputs; outputs are poisoned with NaN first, so
an element the kernel never writes fails. A case passes when nothing is NaN and both
`max|out - ref| <= atol + rtol * |ref|` elementwise and `||out - ref|| / ||ref|| <= rel_l2`:

    dtype      rel_l2  atol   rtol   why
    float32    1e-5    1e-4   1e-4   IEEE dots, float32 accumulation
    float16    2e-3    5e-3   5e-3   probabilities rounded to fp16 before P @ V; output rounding
    bfloat16   1e-2    3e-2   2e-2   the same with 8 mantissa bits

write_kv copies bits, so it must match exactly. Prints a pass/fail table; exits 1 on any failure.
Under TRITON_INTERPRET=1 with `--device cpu --quick` it runs a few small cases on the CPU.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from pagoda.kernels import reference

TOLERANCES = {  # dtype: (rel_l2, atol, rtol)
    torch.float32: (1e-5, 1e-4, 1e-4),
    torch.float16: (2e-3, 5e-3, 5e-3),
    torch.bfloat16: (1e-2, 3e-2, 2e-2),
}


@dataclass
class Result:
    kernel: str
    dtype: str
    case: str
    max_err: float
    rel_l2: float
    ok: bool
    note: str = ""


def compare(kernel: str, dtype: torch.dtype, case: str, got: torch.Tensor, expected: torch.Tensor) -> Result:
    rel_l2_tol, atol, rtol = TOLERANCES[dtype]
    got, expected = got.double(), expected.double()
    if got.isnan().any():
        n = int(got.isnan().sum())
        return Result(kernel, str(dtype)[6:], case, math.nan, math.nan, False, f"{n} NaN/unwritten")
    err = (got - expected).abs()
    max_err = float(err.max()) if err.numel() else 0.0
    rel_l2 = float(err.norm() / expected.norm().clamp_min(1e-30))
    ok = bool((err <= atol + rtol * expected.abs()).all()) and rel_l2 <= rel_l2_tol
    return Result(kernel, str(dtype)[6:], case, max_err, rel_l2, ok)


def attention_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    high_blocks: int = 0,
) -> dict:
    """A flattened batch over a shuffled block table; with high_blocks, ids sit above that many blocks."""
    blocks = [math.ceil(n / block_size) for n in seq_lens]
    total = sum(blocks)
    num_blocks = high_blocks + 2 * total
    ids = high_blocks + torch.randperm(2 * total, device=device)[:total]
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    used = 0
    for s, n in enumerate(blocks):
        table[s, :n] = ids[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=dtype, device=device)
    v_cache = torch.empty(shape, dtype=dtype, device=device)
    # Only the blocks in use get random data: a >2^31-element cache stays cheap to fill.
    k_cache[high_blocks:].normal_()
    v_cache[high_blocks:].normal_()
    return dict(
        q=torch.randn(sum(query_lens), num_heads, head_dim, device=device).to(dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, *query_lens], device=device).cumsum(0).to(torch.int32),
        scale=head_dim**-0.5,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def check_attention(device: str, dtypes: list[torch.dtype], quick: bool) -> Iterator[Result]:
    from pagoda.kernels.attention import paged_attention

    gen = torch.Generator().manual_seed(1234)

    def rand_lens(n: int, lo: int, hi: int) -> list[int]:
        return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()

    # (name, query_lens, seq_lens, heads, kv_heads, head_dim, block_size, high_blocks)
    cases: list[tuple[str, list[int], list[int], int, int, int, int, int]] = [
        ("decode boundaries g4", [1] * 6, [16, 17, 4096, 4097, 1, 15], 32, 8, 128, 16, 0),
        ("decode llama3-8b b64", [1] * 64, rand_lens(64, 1000, 4000), 32, 8, 128, 16, 0),
        ("decode one 32k row", [1], [32768], 32, 8, 128, 16, 0),
        ("decode g1 d64 bs32", [1] * 9, rand_lens(9, 1, 3000), 16, 16, 64, 32, 0),
        ("decode g8 d128 bs64", [1] * 5, rand_lens(5, 1, 5000), 64, 8, 128, 64, 0),
        ("decode g7 (qwen2)", [1] * 4, rand_lens(4, 100, 2000), 28, 4, 128, 16, 0),
        ("prefill whole g4", [700, 129, 2], [700, 129, 2], 32, 8, 128, 16, 0),
        ("prefill g1 d64", [333, 64], [333, 64], 8, 8, 64, 16, 0),
        ("chunk mid-block g4", [100, 37], [1120, 37 + 7], 32, 8, 128, 16, 0),
        ("mixed decode+prefill", [1, 250, 1, 1, 64, 1], [4097, 300, 17, 16, 1000, 2000], 32, 8, 128, 16, 0),
        ("mixed g8 d64 bs32", [1, 90, 1], [500, 90, 33], 32, 4, 64, 32, 0),
        ("int64 offsets >2^31", [1, 1, 40], [3000, 17, 200], 32, 8, 128, 16, 140_000),
    ]
    if quick:
        cases = [
            ("decode boundaries g4", [1] * 4, [16, 17, 33, 1], 8, 2, 32, 16, 0),
            ("mixed decode+prefill", [1, 20, 1], [40, 25, 17], 8, 2, 32, 16, 0),
        ]
    for dtype in dtypes:
        for name, qlens, slens, h, kvh, d, bs, high in cases:
            if dtype == torch.float32 and high:
                continue  # the fp32 cache over 2^31 elements would be 17 GB for no new coverage
            batch = attention_batch(qlens, slens, h, kvh, d, bs, dtype, device, high)
            out = torch.full_like(batch["q"], float("nan"))
            paged_attention(**batch, out=out)
            # The reference computes in float32 whatever its inputs (a float64 cache over 2^31 elements
            # would be 18 GB); a float64 q keeps its output unrounded.
            expected = reference.paged_attention(**{**batch, "q": batch["q"].double()})
            yield compare("paged_attention", dtype, name, out, expected)
            del batch, out, expected


def check_write_kv(device: str, dtypes: list[torch.dtype], quick: bool) -> Iterator[Result]:
    from pagoda.kernels.kv_cache import write_kv

    cases = [
        ("4096 tok, 8x128, 140k blocks", 4096, 8, 128, 16, 140_000),
        ("37 tok, 1x64, bs 32", 37, 1, 64, 32, 50),
    ]
    if quick:
        cases = [("37 tok, 2x32", 37, 2, 32, 16, 20)]
    for dtype in dtypes:
        for name, n, kvh, d, bs, num_blocks in cases:
            if dtype == torch.float32 and num_blocks > 100_000:
                num_blocks = 20_000
            key = torch.randn(n, kvh, d, device=device).to(dtype)
            value = torch.randn(n, kvh, d, device=device).to(dtype)
            # Distinct slots in the top blocks, a tenth of them padding (-1).
            slots = num_blocks * bs - 1 - torch.randperm(min(num_blocks * bs, 4 * n), device=device)[:n]
            slots[torch.rand(n, device=device) < 0.1] = -1
            k_cache = torch.full((num_blocks, bs, kvh, d), float("nan"), dtype=dtype, device=device)
            v_cache = torch.full_like(k_cache, float("nan"))
            k_ref, v_ref = k_cache.clone(), v_cache.clone()
            write_kv(key, value, k_cache, v_cache, slots)
            reference.write_kv(key, value, k_ref, v_ref, slots)
            ok = torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0)) and torch.equal(
                v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0)
            )
            yield Result("write_kv", str(dtype)[6:], name, 0.0 if ok else math.nan, 0.0, ok, "bit-exact")
            del k_cache, v_cache, k_ref, v_ref


def check_rms_norm(device: str, dtypes: list[torch.dtype], quick: bool) -> Iterator[Result]:
    from pagoda.kernels.norm import rms_norm

    cases = [(4096, 4096), (7, 5120), (1, 8192), (1000, 3000), (33, 64)]
    if quick:
        cases = [(5, 200)]
    for dtype in dtypes:
        for n, hidden in cases:
            for with_residual in (False, True):
                x = torch.randn(n, hidden, device=device).to(dtype)
                weight = (1 + 0.2 * torch.randn(hidden, device=device)).to(dtype)
                residual = torch.randn(n, hidden, device=device).to(dtype) if with_residual else None
                out = torch.full_like(x, float("nan"))
                res_out = torch.full_like(x, float("nan")) if with_residual else None
                rms_norm(x, weight, 1e-5, residual, out=out, residual_out=res_out)
                # The float64 reference on the rounded sum: the sum itself is checked bit-exactly.
                x_sum = x + residual if residual is not None else x
                expected, _ = reference.rms_norm(x_sum.double(), weight.double(), 1e-5)
                case = f"{n}x{hidden}" + (" +residual" if with_residual else "")
                result = compare("rms_norm", dtype, case, out, expected)
                if res_out is not None and not torch.equal(res_out, x_sum):
                    result.ok, result.note = False, "residual sum differs"
                yield result


def check_silu_and_mul(device: str, dtypes: list[torch.dtype], quick: bool) -> Iterator[Result]:
    from pagoda.kernels.activation import silu_and_mul

    cases = [(4096, 14336), (5, 11008), (1, 100), (300, 1)]
    if quick:
        cases = [(5, 100)]
    for dtype in dtypes:
        for n, d in cases:
            x = (3 * torch.randn(n, 2 * d, device=device)).to(dtype)
            out = torch.full((n, d), float("nan"), dtype=dtype, device=device)
            silu_and_mul(x, out=out)
            yield compare("silu_and_mul", dtype, f"{n}x{d}", out, reference.silu_and_mul(x.double()))


def llama3_cos_sin_cache(max_position: int, head_dim: int, device: str) -> torch.Tensor:
    """Llama 3.1's rope (theta 500000, factor 8, low/high freq factors 1/4, original 8192)."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / 8, inv_freq)
    medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    inv_freq = torch.where(medium, (1 - smooth) * inv_freq / 8 + smooth * inv_freq, scaled)
    freqs = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float().to(device)


def check_rotary(device: str, dtypes: list[torch.dtype], quick: bool) -> Iterator[Result]:
    from pagoda.kernels.rotary import rotary_embedding

    cases = [(4096, 32, 8, 128), (7, 28, 4, 128), (100, 16, 16, 64), (3, 8, 1, 96)]
    if quick:
        cases = [(5, 4, 2, 32)]
    max_position = 131072 if not quick else 64
    cache = llama3_cos_sin_cache(max_position, 128, device)
    for dtype in dtypes:
        for n, h, kvh, d in cases:
            cos_sin = cache if d == 128 else llama3_cos_sin_cache(max_position, d, device)
            positions = torch.randint(0, max_position, (n,), device=device)
            qkv = torch.randn(n, h + 2 * kvh, d, device=device).to(dtype)
            q, k = qkv[:, :h], qkv[:, h : h + kvh]
            q_ref, k_ref = q.double(), k.double()
            reference.rotary_embedding(positions, q_ref, k_ref, cos_sin.double())
            rotary_embedding(positions, q, k, cos_sin)
            yield compare(
                "rotary_embedding",
                dtype,
                f"{n} tok {h}/{kvh}x{d}",
                torch.cat([q, k], 1),
                torch.cat([q_ref, k_ref], 1),
            )


def check_cuda_graph(device: str, dtypes: list[torch.dtype], quick: bool) -> Iterator[Result]:
    """paged_attention captured once in a CUDA graph, replayed on new inputs of the same shapes."""
    if device != "cuda":
        return
    from pagoda.kernels.attention import paged_attention

    dtype = torch.bfloat16
    qlens, slens = [1, 1, 1, 30], [4000, 33, 17, 100]
    batch = attention_batch(qlens, slens, 32, 8, 128, 16, dtype, device)
    # Capture with grid bounds that hold any later step (max_seq_len 4096), as an engine would.
    batch["max_seq_len"] = 4096
    out = torch.empty_like(batch["q"])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_attention(**batch, out=out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(**batch, out=out)
    for step in range(3):
        batch["q"].normal_()
        batch["seq_lens"].copy_(torch.tensor([4000 - step * 500, 40 + step, 16, 100 + step], device=device))
        out.fill_(float("nan"))
        graph.replay()
        expected = reference.paged_attention(**{**batch, "q": batch["q"].double()})
        yield compare("paged_attention", dtype, f"cuda graph replay {step}", out, expected)


CHECKS: list[Callable[[str, list[torch.dtype], bool], Iterator[Result]]] = [
    check_write_kv,
    check_attention,
    check_rms_norm,
    check_silu_and_mul,
    check_rotary,
    check_cuda_graph,
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few small cases (for the interpreter)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    if args.device == "cpu":
        dtypes = dtypes[:2]  # the interpreter's bf16 tl.dot is wrong
    else:
        print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", end=", ")
    import triton

    print(f"triton {triton.__version__}")
    results: list[Result] = []
    start = time.perf_counter()
    print(f"{'kernel':<17} {'dtype':<9} {'case':<30} {'max_err':>9} {'rel_l2':>9}  result")
    for check in CHECKS:
        try:
            for r in check(args.device, dtypes, args.quick):
                results.append(r)
                verdict = "PASS" if r.ok else "FAIL"
                errors = f"{r.max_err:9.2e} {r.rel_l2:9.2e}"
                print(f"{r.kernel:<17} {r.dtype:<9} {r.case:<30} {errors}  {verdict} {r.note}")
        except Exception as e:  # a crash is a failure of that kernel, the others still run
            results.append(Result(check.__name__, "-", "crashed", math.nan, math.nan, False, repr(e)[:200]))
            print(f"{check.__name__}: CRASH {e!r}"[:300])
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)}/{len(results)} passed in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
