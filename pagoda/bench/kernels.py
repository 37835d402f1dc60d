"""Kernel benchmark: time, bytes moved and bandwidth against a device-to-device copy measured in the run.

    python -m pagoda.bench.kernels [--quick] [--sweep] [--markdown PATH] [--json PATH]

Every time is the median of CUDA-graph replays (`triton.testing.do_bench_cudagraph`: no host launch
overhead, as the engine's decode steps run), in microseconds. "bytes" is the least traffic the
operation needs (each input read once, each output written once; for attention the K/V of every
context token); "of copy" is that traffic's rate over the copy's, both counting reads plus writes.
Peers: PyTorch SDPA on contiguous tensors for attention (flash backend for prefill, as the goal
asks), gather + bmm for multi-LoRA (each token's A and B gathered by `index_select`, then batched
GEMVs: `lora_inputs.gather_bmm_shrink` / `gather_bmm_expand`), the plain-PyTorch reference for the
rest. Llama-3-8B shapes: 32 query heads, 8 KV heads, head dim 128, hidden 4096, intermediate 14336,
bfloat16, block size 16.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

HELP = "time the Triton kernels on this GPU against a device-to-device copy and PyTorch peers"

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DEVICE = "cuda"


@dataclass
class Row:
    kernel: str
    shape: str
    us: float
    bytes: float
    tflops: float = 0.0
    peer: str = ""
    peer_us: float = math.nan
    note: str = ""
    frac_copy: float = math.nan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument(
        "--sweep",
        choices=[
            "configs",
            "splits",
            "fp8",
            "long-prefill",
            "long-prefill-sdpa",
            "long-chunk",
            "fresh-prompts",
        ],
        action="append",
        default=[],
        help="also time tile/warp/stage variants (configs), decode split counts (splits), decode over an "
        "fp8 cache by operand and config (fp8) or prefill configs on 8k-token chunks of 8k-32k contexts "
        "(long-prefill), or PyTorch SDPA's backends on those chunks as a prefix part and a causal part, with "
        "the paged prefix's gather (long-prefill-sdpa), or the engine's cuDNN path for such chunks against "
        "the paged kernel, with its first call on a new shape (long-chunk), or whole prompts without a "
        "cached prefix through the paged kernel's configs and library varlen kernels (fresh-prompts)",
    )
    parser.add_argument("--sweep-only", action="store_true", help="run the sweeps without the table")
    parser.add_argument(
        "--only",
        choices=["decode", "prefill", "small", "lora", "argmax"],
        action="append",
        default=[],
        help="only these sections of the table (default: all)",
    )
    parser.add_argument("--markdown", help="write the results table to this file")
    parser.add_argument("--json", help="write every row to this file")


def _time(fn: Callable[[], object]) -> float:
    """Median microseconds of graph replays, falling back to eager launches if capture fails."""
    import torch
    import triton

    try:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    except Exception:
        torch.cuda.synchronize()
        return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _copy_bandwidth() -> tuple[float, str]:
    """The faster of an eager and a graph-replayed 1 GiB device-to-device copy (read + write bytes).

    In a graph the copy becomes a memcpy node, which ran at 2.7 TB/s on an H200 where the eager
    copy kernel ran at 4.3 TB/s: the eager one is the ceiling to hold kernels to.
    """
    import torch

    src = torch.randn(1 << 29, device=DEVICE, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * src.element_size()
    eager = nbytes / (1e-3 * _eager(lambda: dst.copy_(src)))
    graph = nbytes / (1e-6 * _time(lambda: dst.copy_(src)))
    return max(eager, graph), f"copy eager {eager / 1e12:.2f} TB/s, in a graph {graph / 1e12:.2f} TB/s"


def _paged_batch(seq_lens: list[int], query_lens: list[int]) -> dict:
    """A batch over a shuffled block table (the fragmentation a long-running server has)."""
    import torch

    blocks = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    ids = torch.randperm(sum(blocks), device=DEVICE, dtype=torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=DEVICE)
    used = 0
    for s, n in enumerate(blocks):
        table[s, :n] = ids[used : used + n]
        used += n
    shape = (sum(blocks), BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return dict(
        q=torch.randn(sum(query_lens), HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16),
        k_cache=torch.randn(shape, device=DEVICE, dtype=torch.bfloat16),
        v_cache=torch.randn(shape, device=DEVICE, dtype=torch.bfloat16),
        block_tables=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor([0, *query_lens], device=DEVICE).cumsum(0).to(torch.int32),
        scale=HEAD_DIM**-0.5,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def _as_fp8_cache(b: dict) -> dict:
    """`_paged_batch`'s batch over an fp8 cache in the engine's layout (V token-major)."""
    import torch

    from pagoda.kernels.kv_cache import token_major_copy

    fp8 = torch.float8_e4m3fn
    return {**b, "k_cache": b["k_cache"].to(fp8), "v_cache": token_major_copy(b["v_cache"].to(fp8))}


def _prefill_name(cfg: Any) -> str:
    """A `PrefillConfig`'s row name in the sweeps ("default" for None)."""
    if cfg is None:
        return "default"
    return f"block_m {cfg.block_m} tile {cfg.tile_n} warps {cfg.num_warps} stages {cfg.num_stages}"


def _sdpa(q, k, v, *, is_causal: bool, backend=None) -> tuple[Callable[[], object], str]:
    """SDPA with native GQA if the backend takes it, else on K/V expanded beforehand (not timed).

    backend (an `SDPBackend`) pins that backend; None lets PyTorch pick, as a plain call would.
    """
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def pinned() -> contextlib.AbstractContextManager:
        return sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()

    try:
        with pinned():
            F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
        torch.cuda.synchronize()

        def gqa() -> object:
            with pinned():
                return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)

        return gqa, "gqa"
    except RuntimeError:
        group = q.shape[1] // k.shape[1]
        k2, v2 = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

        def expanded() -> object:
            with pinned():
                return F.scaled_dot_product_attention(q, k2, v2, is_causal=is_causal)

        return expanded, "K/V expanded"


def bench_decode(quick: bool) -> list[Row]:
    import torch

    from pagoda.kernels.attention import DecodeConfig, paged_attention

    cases = [(64, 1024), (64, 2048), (64, 4096), (64, 8192), (128, 1024), (128, 4096), (256, 512), (8, 8192)]
    cases += [(1, 32768), (256, 128)]
    if quick:
        cases = [(64, 1024), (64, 4096)]
    rows = []
    for batch, ctx in cases:
        b = _paged_batch([ctx] * batch, [1] * batch)
        kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2
        io_bytes = kv_bytes + 2 * b["q"].numel() * 2
        us = _time(lambda b=b: paged_attention(**b))
        eager_us = 1e3 * _eager(lambda b=b: paged_attention(**b))
        q = b["q"].view(batch, HEADS, 1, HEAD_DIM)
        k = torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        peer, how = _sdpa(q, k, v, is_causal=False)
        row = Row("paged decode", f"batch {batch} x ctx {ctx}", us, io_bytes, peer="SDPA " + how)
        row.peer_us = _time(peer)
        row.note = f"eager {eager_us:.0f} us"
        rows.append(row)
        # An fp8 cache (--kv-cache-dtype fp8) reads half the bytes; the row's bandwidth counts those.
        fp8 = {k: v.to(torch.float8_e4m3fn) if k in ("k_cache", "v_cache") else v for k, v in b.items()}
        shape = f"batch {batch} x ctx {ctx}"
        for name, cfg in (
            ("", None),
            (", tile 64", DecodeConfig(tile_n=64)),
            (", tile 256", DecodeConfig(tile_n=256, num_warps=8)),
            (", q-dtype dots", DecodeConfig(fp8_dot="q")),
        ):
            fp8_us = _time(lambda f=fp8, c=cfg: paged_attention(**f, decode_config=c))
            rows.append(Row(f"paged decode, fp8 cache{name}", shape, fp8_us, io_bytes - kv_bytes // 2))
        del fp8
        if batch <= 8:  # what splitting the context buys when batch x kv heads cannot fill 132 SMs
            nosplit = _time(lambda b=b: paged_attention(**b, decode_config=DecodeConfig(num_splits=1)))
            rows.append(Row("paged decode, 1 split", f"batch {batch} x ctx {ctx}", nosplit, io_bytes))
        del b, k, v, q
    # Inside CUDA graphs max_seq_len is max_model_len: the per-sequence partition against the old
    # host one cut from max_seq_len (which ran batch 1 at 1.1k context in one split per kv head).
    old = DecodeConfig(partition_by="max_seq_len", min_partition=256)
    for batch, ctx in [(1, 1100), (8, 4096), (64, 1024)] if not quick else [(1, 1100)]:
        b = {**_paged_batch([ctx] * batch, [1] * batch), "max_seq_len": 131072}
        io_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2 + 2 * b["q"].numel() * 2
        shape = f"batch {batch} x ctx {ctx}, max_seq_len 128k"
        rows.append(Row("paged decode", shape, _time(lambda b=b: paged_attention(**b)), io_bytes))
        old_us = _time(lambda b=b: paged_attention(**b, decode_config=old))
        rows.append(Row("paged decode, old partition", shape, old_us, io_bytes))
        del b
    # Ragged: 64 rows of 1k-8k tokens, no SDPA peer (it would pad).
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(1024, 8193, (64,), generator=gen).tolist()
    b = _paged_batch(lens, [1] * 64)
    kv_bytes = 2 * sum(lens) * KV_HEADS * HEAD_DIM * 2
    rows.append(
        Row("paged decode", "batch 64 x ctx 1k-8k ragged", _time(lambda: paged_attention(**b)), kv_bytes)
    )
    return rows


def _eager(fn: Callable[[], object]) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_prefill(quick: bool) -> list[Row]:
    import torch
    from torch.nn.attention import SDPBackend

    from pagoda.kernels.attention import paged_attention

    cases = [(1, 4096), (4, 2048), (8, 1024), (16, 512)]
    if quick:
        cases = [(2, 2048)]
    rows = []
    for batch, length in cases:
        b = _paged_batch([length] * batch, [length] * batch)
        flops = 4 * HEADS * HEAD_DIM * batch * length * (length + 1) / 2
        us = _time(lambda b=b: paged_attention(**b))
        q = b["q"].view(batch, length, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        k = torch.randn(batch, KV_HEADS, length, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        peer, how = _sdpa(q, k, v, is_causal=True, backend=SDPBackend.FLASH_ATTENTION)
        row = Row(
            "paged prefill", f"{batch} x {length} causal", us, 0.0, flops / us / 1e6, "SDPA flash " + how
        )
        row.peer_us = _time(peer)
        rows.append(row)
        del b, q, k, v
    # A chunk of 512 new tokens over 7.5k cached ones, 8 sequences (no SDPA equivalent mask).
    ctx, chunk = 8192, 512
    b = _paged_batch([ctx] * 8, [chunk] * 8)
    flops = 4 * HEADS * HEAD_DIM * 8 * chunk * (ctx - chunk + (chunk + 1) / 2)
    us = _time(lambda: paged_attention(**b))
    rows.append(Row("paged chunked prefill", f"8 x {chunk} new over {ctx} ctx", us, 0.0, flops / us / 1e6))
    return rows


def _row(
    kernel: str, shape: str, fn: Callable[[], object], nbytes: float, peer: Callable[[], object] | None
) -> Row:
    row = Row(kernel, shape, _time(fn), nbytes)
    if peer is not None:
        row.peer, row.peer_us = "torch reference", _time(peer)
    return row


def bench_small(quick: bool) -> list[Row]:
    import torch

    from pagoda.kernels import reference
    from pagoda.kernels.activation import silu_and_mul
    from pagoda.kernels.kv_cache import write_kv
    from pagoda.kernels.norm import rms_norm
    from pagoda.kernels.rotary import rotary_embedding

    tokens = 4096 if quick else 16384
    hidden, inter, bf16 = 4096, 14336, torch.bfloat16
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=bf16)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device=DEVICE, dtype=bf16)
    n = x.numel() * 2
    shape = f"{tokens} x {hidden}"
    rows = [
        _row("rms_norm", shape, lambda: rms_norm(x, w, 1e-5), 2 * n, lambda: reference.rms_norm(x, w, 1e-5)),
        _row(
            "rms_norm + residual",
            shape,
            lambda: rms_norm(x, w, 1e-5, res),
            4 * n,
            lambda: reference.rms_norm(x, w, 1e-5, res),
        ),
    ]

    t = tokens // 2
    gate_up = torch.randn(t, 2 * inter, device=DEVICE, dtype=bf16)
    rows.append(
        _row(
            "silu_and_mul",
            f"{t} x {inter}",
            lambda: silu_and_mul(gate_up),
            3 * t * inter * 2,
            lambda: reference.silu_and_mul(gate_up),
        )
    )

    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, device=DEVICE, dtype=bf16)
    q, k = qkv[:, :HEADS], qkv[:, HEADS : HEADS + KV_HEADS]
    positions = torch.randint(0, 131072, (tokens,), device=DEVICE)
    cos_sin = torch.randn(131072, HEAD_DIM, device=DEVICE)
    rows.append(
        _row(
            "rotary_embedding",
            f"{tokens} tok, {HEADS}+{KV_HEADS} heads",
            lambda: rotary_embedding(positions, q, k, cos_sin),
            2 * tokens * (HEADS + KV_HEADS) * HEAD_DIM * 2 + tokens * HEAD_DIM * 4 + tokens * 8,
            lambda: reference.rotary_embedding(positions, q, k, cos_sin),
        )
    )

    key = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=bf16)
    value = torch.randn_like(key)
    num_blocks = 65536
    k_cache = torch.empty(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=bf16)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:tokens]
    rows.append(
        _row(
            "write_kv",
            f"{tokens} tok, {KV_HEADS}x{HEAD_DIM}, scattered",
            lambda: write_kv(key, value, k_cache, v_cache, slots),
            4 * key.numel() * 2 + tokens * 8,
            None,
        )
    )
    return rows


def bench_argmax(quick: bool) -> list[Row]:
    """Greedy sampling's argmax over Llama-3's vocabulary: the split kernel against torch.argmax, on the
    graphs' bf16 logits and on float32 (processed rows)."""
    import torch

    from pagoda.kernels.argmax_rows import argmax

    vocab, rows = 128256, []
    for batch, dtype in [(1, torch.bfloat16), (1, torch.float32), (8, torch.bfloat16), (64, torch.bfloat16),
                         (256, torch.bfloat16), (640, torch.bfloat16)][: 3 if quick else None]:  # fmt: skip
        x = torch.randn(batch, vocab, device=DEVICE, dtype=dtype)
        nbytes = x.numel() * x.element_size()
        shape = f"{batch} x {vocab} {str(dtype).removeprefix('torch.')}"
        rows.append(_row("argmax", shape, lambda x=x: argmax(x), nbytes, lambda x=x: x.argmax(dim=1)))
    return rows


LORA_PROJECTIONS = {"qkv": (4096, 1024, 1024), "gate_up": (14336, 14336)}  # output columns of each slice
LORA_SLOTS, LORA_RANK = 8, 16


def bench_lora(quick: bool) -> list[Row]:
    """Multi-LoRA's shrink and expand, each kernel against gather + bmm, at K = 4096 with 8 rank-16
    adapters: BGMV for decode batches (token t on adapter t % 8), SGMV for prefill (8 sequences of
    T / 8 tokens, one adapter each). "bytes": x, the used slots' A and v for the shrink; v, the used
    slots' B and y read and written for the expand."""
    import torch

    from pagoda.bench.lora_inputs import gather_bmm_expand, gather_bmm_shrink, lora_inputs
    from pagoda.kernels.lora import lora_expand, lora_shrink

    steps = [("BGMV", t, [1] * t) for t in (1, 16, 64)] + [("SGMV", t, [t // 8] * 8) for t in (512, 2048)]
    if quick:
        steps = [steps[1], steps[3]]
    rows = []
    for proj, slices in LORA_PROJECTIONS.items():
        for form, num_tokens, run_lens in steps:
            run_slots = [i % LORA_SLOTS for i in range(len(run_lens))]
            inp = lora_inputs(
                run_lens, run_slots, 4096, slices, [LORA_RANK] * LORA_SLOTS, torch.bfloat16, DEVICE
            )
            segments = inp.segments if form == "SGMV" else None
            x, a, b, y, slots, starts = inp.x, inp.a, inp.b, inp.y, inp.token_slots, inp.slice_starts
            v = lora_shrink(x, a, slots, segments)
            used = min(LORA_SLOTS, len(run_lens))
            n, r = sum(slices), LORA_RANK
            shape = f"{proj}, {num_tokens} tok, {LORA_SLOTS} x rank {r}"
            v_bytes = v.numel() * 4
            shrink = Row(
                f"lora shrink ({form})",
                shape,
                _time(lambda x=x, a=a, s=slots, g=segments: lora_shrink(x, a, s, g)),
                x.numel() * 2 + used * len(slices) * r * 4096 * 2 + v_bytes,
                peer="gather + bmm",
            )
            shrink.peer_us = _time(lambda x=x, a=a, s=slots: gather_bmm_shrink(x, a, s))
            expand = Row(
                f"lora expand ({form})",
                shape,
                _time(lambda v=v, b=b, s=slots, y=y, st=starts, g=segments: lora_expand(v, b, s, y, st, g)),
                v_bytes + used * n * r * 2 + 2 * y.numel() * 2,
                peer="gather + bmm",
            )
            expand.peer_us = _time(
                lambda v=v, b=b, s=slots, y=y, st=starts: gather_bmm_expand(v, b, s, y, st)
            )
            rows += [shrink, expand]
            del inp, x, a, b, y, v
            torch.cuda.empty_cache()
    return rows


def sweep(copy_bw: float) -> list[str]:
    """Tile, warp, stage and split variants of both attention kernels, for picking the defaults."""
    from pagoda.kernels.attention import DecodeConfig, PrefillConfig, paged_attention

    lines = [
        "decode sweep (us, fraction of copy bandwidth) at batch x ctx 64x1024 | 64x4096 | 8x8192 | 256x512:"
    ]
    decode_cases = [(64, 1024), (64, 4096), (8, 8192), (256, 512)]
    batches = {c: _paged_batch([c[1]] * c[0], [1] * c[0]) for c in decode_cases}
    variants = [
        DecodeConfig(tile_n=t, num_warps=w, num_stages=s)
        for t in (32, 64, 128)
        for w in (4, 8)
        for s in (2, 3)
    ]
    variants += [DecodeConfig(num_stages=4), DecodeConfig(tile_n=32, num_stages=4)]
    variants += [DecodeConfig(programs_per_sm=p) for p in (2, 4, 16)]
    variants += [DecodeConfig(min_partition=m) for m in (64, 256, 1024)]
    for cfg in variants:
        cells = []
        for (batch, ctx), b in batches.items():
            try:
                us = _time(lambda b=b, cfg=cfg: paged_attention(**b, decode_config=cfg))
                frac = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2 / (us * 1e-6) / copy_bw
                cells.append(f"{us:7.1f} {frac:4.2f}")
            except Exception as e:
                cells.append(f"error {type(e).__name__}")
        name = f"tile {cfg.tile_n} warps {cfg.num_warps} stages {cfg.num_stages} pps {cfg.programs_per_sm}"
        lines.append(f"  {name} min_part {cfg.min_partition}: " + " | ".join(cells))
        print(lines[-1], flush=True)
    del batches
    lines.append("prefill sweep (us, TFLOP/s) at 1x4096 | 4x2048 | 16x512 causal:")
    prefill_cases = [(1, 4096), (4, 2048), (16, 512)]
    batches = {c: _paged_batch([c[1]] * c[0], [c[1]] * c[0]) for c in prefill_cases}
    variants_p = [
        PrefillConfig(m, n, w, s)
        for m, n, w, s in [
            (128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 64, 4, 3), (128, 128, 8, 2),
            (128, 32, 4, 3), (64, 64, 4, 3), (64, 128, 4, 2), (128, 32, 8, 4), (256, 64, 8, 2),
        ]
    ]  # fmt: skip
    for cfg in variants_p:
        cells = []
        for (batch, length), b in batches.items():
            try:
                us = _time(lambda b=b, cfg=cfg: paged_attention(**b, prefill_config=cfg))
                flops = 4 * HEADS * HEAD_DIM * batch * length * (length + 1) / 2
                cells.append(f"{us:8.1f} {flops / us / 1e6:5.0f}")
            except Exception as e:
                cells.append(f"error {type(e).__name__}")
        name = _prefill_name(cfg)
        lines.append(f"  {name}: " + " | ".join(cells))
        print(lines[-1], flush=True)
    return lines


def sweep_splits(copy_bw: float) -> list[str]:
    """Decode time by split scheme, with max_seq_len as the engine passes it: the batch's longest
    context when eager, max_model_len (32k, 128k here) inside CUDA graphs.

    "old" is the partition cut from max_seq_len on the host (the scheme before per-sequence
    partitions, `partition_by="max_seq_len"`); "min N" the per-sequence partition of at least N
    tokens; "N splits" a fixed split count at min 64. The default is marked *.
    """
    import torch

    from pagoda.kernels.attention import DecodeConfig, paged_attention

    default = DecodeConfig()
    schemes = [("old", DecodeConfig(partition_by="max_seq_len", min_partition=256))]
    schemes += [(f"min {m}", DecodeConfig(min_partition=m)) for m in (64, 128, 256, 512)]
    schemes += [(f"{n} splits", DecodeConfig(num_splits=n, min_partition=64)) for n in (1, 8, 32)]
    lines = ["decode splits sweep (us; old = host partition from max_seq_len, the default marked *):"]
    cases = [
        (1, 1100, 1100), (1, 1100, 32768), (1, 1100, 131072), (1, 4096, 32768), (1, 32768, 32768),
        (4, 1024, 131072), (8, 4096, 131072), (16, 1024, 32768), (64, 1024, 1024), (64, 1024, 32768),
        (64, 1024, 131072),
    ]  # fmt: skip
    for batch, ctx, max_seq_len in cases:
        b = {**_paged_batch([ctx] * batch, [1] * batch), "max_seq_len": max_seq_len}
        cells = []
        for name, cfg in schemes:
            us = _time(lambda b=b, cfg=cfg: paged_attention(**b, decode_config=cfg))
            cells.append(f"{name}{'*' if cfg == default else ''} {us:.1f}")
        auto = _time(lambda b=b: paged_attention(**b))
        frac = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2 / (auto * 1e-6) / copy_bw
        shape = f"batch {batch:3d} x ctx {ctx:5d}, max_seq_len {max_seq_len:6d}"
        lines.append(f"  {shape}: " + " | ".join(cells) + f"  (default {auto:.1f} us, {frac:.0%} of copy)")
        print(lines[-1], flush=True)
        del b
        torch.cuda.empty_cache()
    return lines


def causal_chunk_flops(query_len: int, ctx_len: int) -> float:
    """Attention FLOPs of a causal chunk: the last `query_len` tokens of a `ctx_len` context, each
    against the keys up to its own (QK^T and PV, 2 FLOPs a multiply-add, every query head)."""
    keys = query_len * (ctx_len - query_len) + query_len * (query_len + 1) / 2
    return 4 * HEADS * HEAD_DIM * keys


def sweep_long_prefill() -> list[str]:
    """Prefill configs where long prompts spend their time: one 8k-token chunk (the engine's step
    budget for long prompts) first in its context and last in a 32k one, over a bf16 cache and an fp8
    cache with V token-major (the engine's fp8 layout). Each cell: us and TFLOP/s (causal FLOPs)."""
    import torch

    from pagoda.kernels.attention import PrefillConfig, paged_attention

    cases = [(8192, 8192), (8192, 32768)]
    lines = ["long-prefill sweep (us, TFLOP/s) at query x ctx " + " | ".join(f"{q}x{c}" for q, c in cases)]
    base = {c: _paged_batch([c[1]], [c[0]]) for c in cases}
    variants: list[PrefillConfig | None] = [None]
    variants += [
        PrefillConfig(m, n, w, st)
        for m, n, w, st in [
            (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 2), (64, 128, 4, 2),
            (64, 64, 4, 3), (256, 64, 8, 2), (128, 32, 4, 3),
        ]
    ]  # fmt: skip
    for cache in ("bf16", "fp8 V token-major"):
        for cfg in variants:
            cells = []
            for (q_len, ctx), b in base.items():
                b = dict(b)
                if cache != "bf16":
                    b = _as_fp8_cache(b)
                try:
                    us = _time(lambda b=b, cfg=cfg: paged_attention(**b, prefill_config=cfg))
                    cells.append(f"{us:9.1f} {causal_chunk_flops(q_len, ctx) / us / 1e6:5.0f}")
                except Exception as e:
                    cells.append(f"error {type(e).__name__}")
                del b
            torch.cuda.empty_cache()
            name = _prefill_name(cfg)
            lines.append(f"  {cache}, {name}: " + " | ".join(cells))
            print(lines[-1], flush=True)
    return lines


def sweep_long_prefill_sdpa() -> list[str]:
    """What a library attention would give the long chunks of `sweep_long_prefill`: the chunk's queries
    against the cached prefix (no mask) plus against the chunk itself (causal), each an SDPA call on
    contiguous K/V, two calls a chunk as an engine would merge them by log-sum-exp (the merge not timed:
    one pass over the output). Beside them, the gather of the paged prefix into contiguous K/V, from a
    bf16 cache and from an fp8 one (widened on the way). Each cell: us and TFLOP/s (causal FLOPs)."""
    import torch
    from torch.nn.attention import SDPBackend

    cases = [(8192, 8192), (8192, 32768)]
    shapes = " | ".join(f"{q}x{c}" for q, c in cases)
    lines = [f"long-prefill SDPA peers (us, TFLOP/s) at query x ctx {shapes}"]
    backends = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    for name, backend in backends.items():
        cells = []
        for q_len, ctx in cases:
            q = torch.randn(1, HEADS, q_len, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
            k = torch.randn(1, KV_HEADS, ctx, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            prefix = ctx - q_len
            try:
                chunk, how = _sdpa(q, k[:, :, prefix:], v[:, :, prefix:], is_causal=True, backend=backend)
                us = _time(chunk)
                if prefix:
                    head, _ = _sdpa(q, k[:, :, :prefix], v[:, :, :prefix], is_causal=False, backend=backend)
                    us += _time(head)
                cells.append(f"{us:9.1f} {causal_chunk_flops(q_len, ctx) / us / 1e6:5.0f} ({how})")
            except Exception as e:
                cells.append(f"error {type(e).__name__}")
            del q, k, v
            torch.cuda.empty_cache()
        lines.append(f"  SDPA {name}: " + " | ".join(cells))
        print(lines[-1], flush=True)
    # The gather an engine would add: a 24k-token prefix's blocks (shuffled) into [KV_HEADS, tokens, D].
    b = _paged_batch([32768], [8192])
    blocks = b["block_tables"][0, : 24576 // BLOCK_SIZE].long()
    for cache, k_cache in (("bf16", b["k_cache"]), ("fp8", b["k_cache"].to(torch.float8_e4m3fn))):

        def gather(k_cache: torch.Tensor = k_cache) -> torch.Tensor:
            rows = k_cache.index_select(0, blocks).flatten(0, 1)  # [tokens, KV_HEADS, D]
            return rows.to(torch.bfloat16).transpose(0, 1).contiguous()

        us = _time(gather)
        lines.append(f"  gather a 24k-token prefix's K (V the same again), {cache} cache: {us:9.1f} us")
        print(lines[-1], flush=True)
    return lines


# A prefill step of the grid's 2048 / 128 rows (four whole prompts in an 8,192-token budget) and of
# 1000 / 1000's (eight), every prompt fresh: no cached prefix.
FRESH_PROMPT_CASES = ((4, 2048), (8, 1000))


def sweep_fresh_prompts(cases: tuple[tuple[int, int], ...] = FRESH_PROMPT_CASES) -> list[str]:
    """Where a batch of whole prompts (no cached prefix) could attend: the paged kernel over the cache
    by config (bf16, and fp8 with V token-major: the engine's layouts), against library kernels on the
    step's own bf16 q / k / v, which need no cache read: FlashAttention's and cuDNN's variable-length
    forward over the whole batch (one call), and cuDNN's SDPA a prompt at a time. Each cell: us and
    TFLOP/s (causal FLOPs); "error X" where that op refuses the shapes on this PyTorch."""
    import torch
    from torch.nn.attention import SDPBackend

    from pagoda.kernels.attention import PrefillConfig, paged_attention

    shapes = " | ".join(f"{n}x{length}" for n, length in cases)
    lines = [f"fresh-prompt prefill (us, TFLOP/s) at prompts x tokens {shapes}"]

    def cell(fn: Callable[[], object], flops: float) -> str:
        try:
            us = _time(fn)
            return f"{us:8.1f} {flops / us / 1e6:4.0f}"
        except Exception as e:
            return f"error {type(e).__name__}: {str(e)[:60]}"

    configs: list[PrefillConfig | None] = [None]
    configs += [
        PrefillConfig(m, n, w, st)
        for m, n, w, st in [
            (128, 64, 4, 2),
            (128, 64, 8, 2),
            (128, 128, 8, 2),
            (256, 64, 8, 2),
            (64, 64, 4, 3),
        ]
    ]
    for cache in ("bf16", "fp8 V token-major"):
        for cfg in configs:
            cells = []
            for n, length in cases:
                b = _paged_batch([length] * n, [length] * n)
                if cache != "bf16":
                    b = _as_fp8_cache(b)
                flops = n * causal_chunk_flops(length, length)
                cells.append(cell(lambda b=b, cfg=cfg: paged_attention(**b, prefill_config=cfg), flops))
                del b
            torch.cuda.empty_cache()
            name = _prefill_name(cfg)
            lines.append(f"  paged kernel, {cache} cache, {name}: " + " | ".join(cells))
            print(lines[-1], flush=True)
    library: dict[str, list[str]] = {
        "flash varlen": [],
        "cudnn varlen": [],
        "cudnn SDPA a prompt at a time": [],
    }
    for n, length in cases:
        total = n * length
        q = torch.randn(total, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
        k = torch.randn(total, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cu = torch.arange(0, total + 1, length, device=DEVICE, dtype=torch.int32)
        flops = n * causal_chunk_flops(length, length)

        def flash(q=q, k=k, v=v, cu=cu, length=length) -> object:
            return torch.ops.aten._flash_attention_forward(
                q, k, v, cu, cu, length, length, 0.0, True, False, scale=HEAD_DIM**-0.5
            )

        def cudnn(q=q, k=k, v=v, cu=cu, length=length) -> object:
            return torch.ops.aten._cudnn_attention_forward(
                q, k, v, None, cu, cu, length, length, False, 0.0, True, False, scale=HEAD_DIM**-0.5
            )

        qs = [q[i * length : (i + 1) * length].transpose(0, 1).unsqueeze(0) for i in range(n)]
        ks = [k[i * length : (i + 1) * length].transpose(0, 1).unsqueeze(0).contiguous() for i in range(n)]
        vs = [v[i * length : (i + 1) * length].transpose(0, 1).unsqueeze(0).contiguous() for i in range(n)]

        def per_prompt(qs=qs, ks=ks, vs=vs) -> object:
            with torch.nn.attention.sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return [
                    torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True)
                    for a, b, c in zip(qs, ks, vs, strict=True)
                ]

        library["flash varlen"].append(cell(flash, flops))
        library["cudnn varlen"].append(cell(cudnn, flops))
        library["cudnn SDPA a prompt at a time"].append(cell(per_prompt, flops))
        del q, k, v, qs, ks, vs
        torch.cuda.empty_cache()
    for name, cells in library.items():
        lines.append(f"  {name}, bf16 q/k/v of the step: " + " | ".join(cells))
        print(lines[-1], flush=True)
    return lines


# 8k-token chunks (the engine's budget) at 8k-32k contexts, one whose lengths are no bucket's multiple,
# and the chunks of a batch of 32k prompts once 7 others decode (8,185 tokens behind 16,370 / 24,555).
LONG_CHUNK_CASES = ((8192, 8192), (8192, 16384), (8192, 32768), (8000, 24500), (8185, 24555), (8185, 32740))
# cuDNN's shape buckets (cudnn_attention.SHAPE_BUCKET and a finer one): padded rows against plan builds.
LONG_CHUNK_BUCKETS = (512, 128)


def sweep_long_chunk(
    cases: tuple[tuple[int, int], ...] = LONG_CHUNK_CASES, buckets: tuple[int, ...] = LONG_CHUNK_BUCKETS
) -> list[str]:
    """The engine's path for long chunks (`cudnn_attention.chunk_attention`: the gather, cuDNN's two
    calls, the merge) at each shape bucket, and at the first bucket with q / K / V handed over as
    strided views of token-major tensors (`token_major`: no head-major copies), against the paged kernel
    with its long-prefill tiles, on the same bf16 and fp8 (V token-major) caches; "first" is the first
    call on that shape, cuDNN's plan build included; "diff" the largest difference between the two
    outputs."""
    import time

    import torch
    import triton

    from pagoda.kernels.attention import paged_attention
    from pagoda.kernels.cudnn_attention import chunk_attention

    shapes = " | ".join(f"{q}x{c}" for q, c in cases)
    lines = [f"long-chunk path (us, TFLOP/s; first call ms; diff) at query x ctx {shapes}"]
    for cache in ("bf16", "fp8 V token-major"):
        variants = [(bucket, False) for bucket in buckets] + [(buckets[0], True)]
        ours: dict[tuple[int, bool], list[str]] = {variant: [] for variant in variants}
        paged = []
        for q_len, ctx in cases:
            b = _paged_batch([ctx], [q_len])
            if cache != "bf16":
                b = _as_fp8_cache(b)
            want = paged_attention(**b)
            flops = causal_chunk_flops(q_len, ctx)
            for bucket, token_major in variants:
                out = torch.empty_like(b["q"])
                args = (b["q"], b["k_cache"], b["v_cache"], b["block_tables"][0], ctx, b["scale"], out)
                kwargs = {"bucket": bucket, "token_major": token_major}
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                chunk_attention(*args, **kwargs)
                torch.cuda.synchronize()
                first_ms = 1e3 * (time.perf_counter() - t0)
                diff = (out.float() - want.float()).abs().max().item()
                us = 1e3 * triton.testing.do_bench(
                    lambda args=args, kwargs=kwargs: chunk_attention(*args, **kwargs), return_mode="median"
                )
                ours[bucket, token_major].append(
                    f"{us:8.1f} {flops / us / 1e6:4.0f} (first {first_ms:.0f} ms, diff {diff:.3f})"
                )
                del out
            us = _time(lambda b=b: paged_attention(**b))
            paged.append(f"{us:8.1f} {flops / us / 1e6:4.0f}")
            del b, want
            torch.cuda.empty_cache()
        rows = [
            (f"cuDNN chunk path, bucket {bucket}" + (", token-major views" if token_major else ""), cells)
            for (bucket, token_major), cells in ours.items()
        ]
        for name, cells in (*rows, ("paged kernel", paged)):
            lines.append(f"  {cache}, {name}: " + " | ".join(cells))
            print(lines[-1], flush=True)
    return lines


def sweep_fp8(copy_bw: float) -> list[str]:
    """Decode over an fp8 cache with bf16 q, as the engine runs it: V slot-major (widened by a cast or
    by PTX) against V token-major (`kv_cache.cache_view`, the engine's layout for an fp8 cache), by
    tile and pipeline stages, beside the bf16 cache. Each cell: us and the fraction of copy bandwidth
    its own cache bytes reach. (Which operand cost, K or V, was measured with mixed dtypes: BENCHMARKS.md,
    2026-12-02.)"""
    import torch

    from pagoda.kernels.attention import DecodeConfig, paged_attention
    from pagoda.kernels.kv_cache import token_major_copy

    # Contexts of whole 64-token tiles, and three ragged ones, whose last tile is masked; 1024 x 190 is
    # 128 / 128 x 1,024's decode step, where the kernel ran at ~0.66 of copy (BENCHMARKS.md, 2026-12-07);
    # 1024 x 192 the same step in whole tiles (the masked tile's share of it).
    cases = [
        (256, 256),
        (64, 1024),
        (640, 1536),
        (8, 8192),
        (256, 200),
        (640, 1500),
        (1024, 190),
        (1024, 192),
    ]
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    lines = [
        "fp8-cache decode sweep (us, fraction of copy) at batch x ctx "
        + " | ".join(f"{b}x{c}" for b, c in cases)
    ]
    base = {(batch, ctx): _paged_batch([ctx] * batch, [1] * batch) for batch, ctx in cases}  # bf16, once

    def batch_of(cache_dtype: torch.dtype, token_major: bool, batch: int, ctx: int) -> dict:
        b = dict(base[batch, ctx])
        b["k_cache"] = b["k_cache"].to(cache_dtype)
        v = b["v_cache"].to(cache_dtype)
        b["v_cache"] = token_major_copy(v) if token_major else v
        return b

    def cells(cache_dtype: torch.dtype, token_major: bool, cfg: DecodeConfig | None) -> str:
        out = []
        for batch, ctx in cases:
            b = batch_of(cache_dtype, token_major, batch, ctx)
            nbytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * b["k_cache"].element_size()
            try:
                us = _time(lambda b=b: paged_attention(**b, decode_config=cfg))
                out.append(f"{us:7.1f} {nbytes / (us * 1e-6) / copy_bw:4.2f}")
            except Exception as e:
                out.append(f"error {type(e).__name__}")
            del b
        torch.cuda.empty_cache()
        return " | ".join(out)

    # The engine's defaults first (bf16, masked tail; fp8 with V token-major, tile 64, read whole over a
    # finite cache), then the alternatives. Dropped after the H100 sweeps of 2026-12-07 (BENCHMARKS.md),
    # slower at every short context: 8 warps, stages 3 with the masked tail, register caps below 96.
    finite = {"finite_cache": True}
    variants: list[tuple[str, torch.dtype, bool, DecodeConfig | None]] = [
        ("bf16 cache, default", bf16, False, None),
        ("fp8, V token-major, default (64/2/4, finite cache)", fp8, True, None),
        ("fp8, V token-major, 64/2/4, masked tail", fp8, True, DecodeConfig()),
        (
            "fp8, V slot-major, tile 64, widen v, finite cache",
            fp8,
            False,
            DecodeConfig(fp8_widen="v", **finite),
        ),
    ]
    # The finite loop compiles to 96 registers at tile 64 (128 masked): 5 programs an SM, not 4.
    variants += [
        (f"fp8, V token-major, {t}/{st}/{w}, finite cache" + (f", {p} programs an SM" if p != 4 else ""),
         fp8, True, DecodeConfig(tile_n=t, num_stages=st, num_warps=w, programs_per_sm=p, **finite))
        for t, st, w, p in (
            (64, 2, 4, 5), (64, 3, 4, 4), (128, 2, 4, 4), (32, 2, 2, 4), (32, 2, 4, 4), (32, 3, 2, 4),
            (64, 2, 2, 4),
        )
    ]  # fmt: skip
    variants += [
        (
            "fp8, V token-major, 64/2/4, finite cache, maxnreg 80",
            fp8,
            True,
            DecodeConfig(maxnreg=80, **finite),
        ),
        ("bf16 cache, finite cache", bf16, False, DecodeConfig(**finite)),
        ("bf16 cache, V token-major, tile 64", bf16, True, DecodeConfig()),
    ]
    for name, dtype, token_major, cfg in variants:
        lines.append(f"  {name}: " + cells(dtype, token_major, cfg))
        print(lines[-1], flush=True)
    return lines


def _table(rows: list[Row], copy_bw: float, gpu: str, versions: str) -> str:
    out = [
        f"GPU: {gpu}; {versions}; copy bandwidth (device-to-device, read + write) {copy_bw / 1e12:.2f} TB/s",
        "",
        "| kernel | shape | time (us) | bytes (MB) | TB/s | of copy | TFLOP/s | peer | peer (us) "
        "| ours / peer | note |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for r in rows:
        tbps = r.bytes / (r.us * 1e-6) / 1e12 if r.bytes else math.nan
        r.frac_copy = tbps * 1e12 / copy_bw if r.bytes else math.nan
        cells = [
            r.kernel,
            r.shape,
            f"{r.us:.1f}",
            f"{r.bytes / 1e6:.0f}" if r.bytes else "",
            f"{tbps:.2f}" if r.bytes else "",
            f"{r.frac_copy:.0%}" if r.bytes else "",
            f"{r.tflops:.0f}" if r.tflops else "",
            r.peer,
            f"{r.peer_us:.1f}" if not math.isnan(r.peer_us) else "",
            f"{r.us / r.peer_us:.2f}" if not math.isnan(r.peer_us) else "",
            r.note,
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    import torch
    import triton

    if not torch.cuda.is_available():
        print("pagoda bench kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name()
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    copy_bw, copy_note = _copy_bandwidth()
    versions += f"; {copy_note}"
    print(f"{gpu}; {versions}", flush=True)
    rows: list[Row] = []
    sections = {
        "decode": bench_decode,
        "prefill": bench_prefill,
        "small": bench_small,
        "lora": bench_lora,
        "argmax": bench_argmax,
    }
    chosen = [sections[name] for name in args.only] if args.only else list(sections.values())
    for section in () if args.sweep_only else chosen:
        try:
            rows += section(args.quick)
        except Exception as e:  # report what ran; a broken section must not hide the others
            print(f"{section.__name__} failed: {e!r}", flush=True)
        torch.cuda.empty_cache()
    table = _table(rows, copy_bw, gpu, versions)
    print(table, flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "copy_bw": copy_bw, "rows": [asdict(r) for r in rows]}, f, indent=1)
    sweep_lines = sweep(copy_bw) if "configs" in args.sweep else []
    sweep_lines += sweep_splits(copy_bw) if "splits" in args.sweep else []
    sweep_lines += sweep_fp8(copy_bw) if "fp8" in args.sweep else []
    sweep_lines += sweep_long_prefill() if "long-prefill" in args.sweep else []
    sweep_lines += sweep_long_prefill_sdpa() if "long-prefill-sdpa" in args.sweep else []
    sweep_lines += sweep_long_chunk() if "long-chunk" in args.sweep else []
    sweep_lines += sweep_fresh_prompts() if "fresh-prompts" in args.sweep else []
    if sweep_lines and args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n" + "\n".join(sweep_lines) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda bench kernels", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
