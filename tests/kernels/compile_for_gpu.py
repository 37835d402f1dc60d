"""Compile every Triton kernel for an H100/H200 (sm_90) on a machine without a GPU, with the arguments
the kernels' own Python wrappers launch them with.

The interpreter (`TRITON_INTERPRET=1`, tests/kernels/check_*.py) runs the kernels' arithmetic but
not the compiler, which refuses some programs the interpreter accepts (a name rebound to another
dtype inside a runtime `if`, for one). Here each wrapper is called on CPU tensors with every kernel's
`run` replaced by a recorder; the recorded launch becomes a signature that `triton.compile` builds
for sm_90 down to a cubin (Triton's bundled ptxas), no driver needed. Every launch that goes through
`pdl.flags` is built with programmatic dependent launch on (as by default on a Hopper GPU), and its
PTX must hold the `griddepcontrol` wait and release that make the early launch safe: a kernel launched
early that reads before it waits races with the kernel before it.

    python tests/kernels/compile_for_gpu.py     # one line a launch; exit 1 if any fails to compile
    python tests/kernels/compile_for_gpu.py --fp8-decode-ptx   # see fp8_decode_ptx

Run without TRITON_INTERPRET (so the kernels are compiled as on the GPU, `quant._HAND_ROUNDING` off).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.int64: "i64",
    torch.int32: "i32",
}
_OPTIONS = ("num_warps", "num_stages", "launch_pdl", "maxnreg")


def _type(value: Any) -> str | tuple:
    if isinstance(value, tuple):  # a tuple argument (lora's slice_starts): its elements' types
        return tuple(_type(v) for v in value)
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def build(fn: JITFunction, args: tuple[Any, ...], kwargs: dict[str, Any], aligned: bool = False) -> Any:
    """Compile one recorded launch for sm_90. `aligned` marks every pointer, and every integer that is
    a multiple of 16, as divisible by 16, as the launcher specializes them on a GPU (vector loads)."""
    names = fn.arg_names
    bound = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    constexprs = {name for p, name in zip(fn.params, names, strict=True) if p.is_constexpr}
    signature = {n: "constexpr" if n in constexprs else _type(bound[n]) for n in names}
    values = {(names.index(n),): bound[n] for n in constexprs}
    options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if aligned
        and n not in constexprs
        and (isinstance(bound[n], torch.Tensor) or (type(bound[n]) is int and bound[n] % 16 == 0))
    }
    source = ASTSource(fn=fn, signature=signature, constexprs=values, attrs=attrs)
    return triton.compile(source, target=TARGET, options=options)


def compile_launch(fn: JITFunction, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Build one recorded launch for sm_90; returns what to print: the cubin's size, its register cap if
    launched with one, and "PDL" for a launch with programmatic dependent launch (raises if its kernel
    does not wait for its inputs)."""
    kernel = build(fn, args, kwargs)
    size = f"{len(kernel.asm['cubin'])} bytes of sm_90 code"
    if kwargs.get("maxnreg"):  # a register cap reaches ptxas as the PTX's .maxnreg directive
        if f".maxnreg {kwargs['maxnreg']}" not in kernel.asm["ptx"]:
            raise RuntimeError(f"{fn.__name__} launched with maxnreg {kwargs['maxnreg']}: its PTX has no cap")
        size += f", maxnreg {kwargs['maxnreg']}"
    if not kwargs.get("launch_pdl"):
        return size
    ptx = kernel.asm["ptx"]
    if "griddepcontrol.wait" not in ptx or "griddepcontrol.launch_dependents" not in ptx:
        raise RuntimeError(f"{fn.__name__} is launched early (launch_pdl) but never waits: call await_inputs")
    return size + ", PDL"


def fp8_decode_ptx() -> dict[str, dict[str, int]]:
    """Per `DecodeConfig.fp8_widen`, counts of the shared-memory reads in the decode kernel's sm_90 PTX,
    at the engine's GPU tiles over an fp8 cache (bf16 q, Llama-3-8B heads): byte-wise reads
    (`ld.shared.b8`) are the slow V path `attention._widen_fp8` avoids; `ldmatrix...trans` reads V as
    16-bit. Call with JITFunction.run recording (`main` sets it)."""
    from pagoda.kernels import attention
    from pagoda.kernels.kv_cache import cache_view

    counts = {}
    for widen in ("cast", "v", "token-major"):
        recorded.clear()
        q = torch.randn(4, 32, 128).bfloat16()
        cache = torch.randn(64, 16, 8, 128).to(torch.float8_e4m3fn)
        v_cache = (
            cache_view(cache.view(64, -1), 16, 8, 128, token_major=True) if widen == "token-major" else cache
        )
        tables = torch.arange(64, dtype=torch.int32).view(4, 16)
        seq_lens = torch.full((4,), 200, dtype=torch.int32)
        starts = torch.arange(5, dtype=torch.int32)
        mode = "v" if widen == "token-major" else widen
        cfg = attention.DecodeConfig(tile_n=64, num_warps=4, num_stages=2, fp8_widen=mode)  # type: ignore[arg-type]
        attention.paged_attention(
            q, cache, v_cache, tables, seq_lens, starts, 0.08, 1, 256, decode_config=cfg
        )
        fn, args, kwargs = recorded[0]
        ptx = build(fn, args, kwargs, aligned=True).asm["ptx"]
        counts[widen] = {
            "ld.shared.b8": ptx.count("ld.shared.b8"),
            "ldmatrix trans": ptx.count(".trans.shared"),
            "cp.async 16-byte": ptx.count("cp.async.cg.shared.global"),  # .cg copies 16 bytes only
            "cp.async narrower": ptx.count("cp.async.ca.shared.global"),
            "ld.global byte": ptx.count("ld.global.b8") + ptx.count("ld.global.u8"),
        }
    return counts


def _launches() -> list[tuple[str, Callable[[], object]]]:
    """Each wrapper call on CPU tensors, with the shapes and flags the engine uses (Llama-3-8B-like)."""
    from pagoda.kernels import (
        LoraSegments,
        activation,
        argmax_rows,
        attention,
        fp8_gemm,
        kv_cache,
        lora,
        lse_merge,
        norm,
        quant,
        rotary,
        seeded_noise,
    )

    bf16, f32, fp8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn

    def r(*shape: int, dtype: torch.dtype = bf16) -> torch.Tensor:
        return torch.randn(*shape).to(dtype)

    num_blocks, block = 8, 16
    cache, cache8 = r(num_blocks, block, 2, 128), r(num_blocks, block, 2, 128, dtype=fp8)
    slots = torch.arange(4, dtype=torch.int64)
    cos_sin = r(64, 128, dtype=f32)
    positions = torch.arange(4, dtype=torch.int64)

    def qkv() -> tuple[torch.Tensor, ...]:
        x = r(4, 8 * 128)
        return tuple(x.view(4, 8, 128).split([4, 2, 2], dim=1))

    q_scales = (r(4, 1, dtype=f32), r(1, 8 * 128, dtype=f32))

    v8_token_major = kv_cache.cache_view(r(num_blocks, block * 2 * 128, dtype=fp8), block, 2, 128, True)

    # Multi-LoRA at the GPU's tiles (a CUDA device's LoraConfig), qkv of Llama-3-8B: 3 slices, rank 16.
    lora_cfg = lora.LoraConfig()
    lora_slots = torch.tensor([0, -1, 2, 2], dtype=torch.int32)
    runs = LoraSegments(
        torch.tensor([0, 1, 2, 4], dtype=torch.int32), torch.tensor([0, -1, 2], dtype=torch.int32), 2
    )
    qkv_starts = (0, 4096, 5120, 6144)

    def lora_call(segments: LoraSegments | None, dtype: torch.dtype = bf16) -> None:
        v = lora.lora_shrink(r(4, 4096, dtype=dtype), r(3, 3, 16, 4096, dtype=dtype), lora_slots, segments,
                             config=lora_cfg)  # fmt: skip
        lora.lora_expand(v, r(3, 6144, 16, dtype=dtype), lora_slots, r(4, 6144, dtype=dtype), qkv_starts,
                         segments, config=lora_cfg)  # fmt: skip

    def attention_call(
        query_len: int, kv: torch.Tensor, v: torch.Tensor | None = None, **decode: Any
    ) -> object:
        q = r(2 * query_len, 4, 128)
        seq_lens = torch.tensor([20, 30], dtype=torch.int32)
        starts = torch.tensor([0, query_len, 2 * query_len], dtype=torch.int32)
        tables = torch.arange(4, dtype=torch.int32).view(2, 2)
        cfg = attention.DecodeConfig(**decode) if decode else None
        return attention.paged_attention(
            q, kv, kv if v is None else v, tables, seq_lens, starts, 0.08, query_len, 30, decode_config=cfg
        )

    def seeded3() -> torch.Tensor:  # three seeded rows: (row, key low, key high) each
        return torch.zeros(3, 3, dtype=torch.int32)

    def merge_call() -> None:  # cuDNN's two parts of a long chunk: [32 heads, rows, 128], strided
        part = r(40, 32, 128).transpose(0, 1)[:, 3:35]
        lse = r(32, 40, dtype=f32)[:, 3:35]
        lse_merge.merge_attention(r(32, 32, 128), part, lse, part, lse, 1.0)

    return [
        ("argmax bf16", lambda: argmax_rows.argmax(r(4, 128256))),
        ("argmax float32", lambda: argmax_rows.argmax(r(4, 128256, dtype=f32))),
        ("lse merge", merge_call),
        ("seeded noise", lambda: seeded_noise.fill_seeded_noise(r(4, 128256, dtype=f32), seeded3())),
        (
            "seeded noise and uniform",
            lambda: seeded_noise.fill_seeded_noise(r(4, 128256, dtype=f32), seeded3(), r(4, dtype=f32)),
        ),
        ("rms_norm", lambda: norm.rms_norm(r(4, 512), r(512), 1e-5)),
        (
            "rms_norm residual quantize",
            lambda: norm.rms_norm(r(4, 512), r(512), 1e-5, r(4, 512), quantize=True),
        ),
        (
            "rms_norm scaled",
            lambda: norm.rms_norm(
                r(4, 512),
                r(512),
                1e-5,
                r(4, 512),
                quantize=True,
                scales=(r(4, 1, dtype=f32), r(1, 512, dtype=f32)),
                scaled_dtype=bf16,
            ),
        ),
        ("silu_and_mul", lambda: activation.silu_and_mul(r(4, 2 * 14336))),
        ("silu quantize tiled", lambda: activation.silu_and_mul(r(4, 2 * 14336), quantize=True)),
        ("silu quantize per row", lambda: activation.silu_and_mul(r(128, 2 * 14336), quantize=True)),
        (
            "silu quantize tiled scaled",
            lambda: activation.silu_and_mul(
                r(4, 2 * 512),
                quantize=True,
                scales=(r(4, 1, dtype=f32), r(1, 1024, dtype=f32)),
                scaled_dtype=bf16,
            ),
        ),
        ("quantize_fp8_rows", lambda: quant.quantize_fp8_rows(r(4, 4096))),
        (
            "scale_product",
            lambda: quant.scale_product(r(4, 512), r(4, 1, dtype=f32), r(1, 512, dtype=f32), bf16),
        ),
        ("write_kv", lambda: kv_cache.write_kv(r(4, 2, 128), r(4, 2, 128), cache, cache.clone(), slots)),
        (
            "write_kv fp8",
            lambda: kv_cache.write_kv(r(4, 2, 128), r(4, 2, 128), cache8, cache8.clone(), slots),
        ),
        (
            "write_kv fp8 V token-major",
            lambda: kv_cache.write_kv(r(4, 2, 128), r(4, 2, 128), cache8, v8_token_major, slots),
        ),
        ("rotary", lambda: rotary.rotary_embedding(positions, r(4, 4, 128), r(4, 2, 128), cos_sin)),
        (
            "rotary kv_write fp8 V token-major",
            lambda: rotary.rotary_embedding(
                positions, *qkv()[:2], cos_sin, (qkv()[2], cache8, v8_token_major, slots, 1.0, 1.0)
            ),
        ),
        (
            "rotary kv_write fp8",
            lambda: rotary.rotary_embedding(
                positions, *qkv()[:2], cos_sin, (qkv()[2], cache8, cache8.clone(), slots, 1.0, 1.0)
            ),
        ),
        (
            "rotary scaled",
            lambda: rotary.rotary_embedding(
                positions,
                *qkv()[:2],
                cos_sin,
                (qkv()[2], cache, cache.clone(), slots, 1.0, 1.0),
                scales=q_scales,
                scaled_dtype=bf16,
                q_out=r(4, 4, 128),
            ),
        ),
        (
            "rotary scaled kv_out fp8 V token-major",
            lambda: rotary.rotary_embedding(
                positions,
                *qkv()[:2],
                cos_sin,
                (qkv()[2], cache8, v8_token_major, slots, 1.0, 1.0),
                scales=q_scales,
                scaled_dtype=bf16,
                q_out=r(4, 4, 128),
                kv_out=(r(4, 2, 128), r(4, 2, 128)),
            ),
        ),
        (
            "rotary q_out kv_out",
            lambda: rotary.rotary_embedding(
                positions,
                *qkv()[:2],
                cos_sin,
                (qkv()[2], cache, cache.clone(), slots, 1.0, 1.0),
                q_out=r(4, 4, 128),
                kv_out=(r(4, 2, 128), r(4, 2, 128)),
            ),
        ),
        ("attention decode", lambda: attention_call(1, cache)),
        ("attention decode fp8", lambda: attention_call(1, cache8)),
        ("attention prefill", lambda: attention_call(7, cache)),
        ("attention prefill fp8", lambda: attention_call(7, cache8)),
        ("attention decode fp8 V token-major", lambda: attention_call(1, cache8, v=v8_token_major)),
        ("attention prefill fp8 V token-major", lambda: attention_call(7, cache8, v=v8_token_major)),
        (  # the register cap `bench kernels --sweep fp8` times (DecodeConfig.maxnreg)
            "attention decode fp8 V token-major, maxnreg 80",
            lambda: attention_call(1, cache8, v=v8_token_major, maxnreg=80),
        ),
        (  # one pipelined loop over a finite cache (DecodeConfig.finite_cache)
            "attention decode fp8 V token-major, finite cache",
            lambda: attention_call(1, cache8, v=v8_token_major, finite_cache=True),
        ),
        ("attention decode bf16, finite cache", lambda: attention_call(1, cache, finite_cache=True)),
        ("lora bgmv", lambda: lora_call(None)),
        ("lora sgmv", lambda: lora_call(runs)),
        ("lora sgmv float32", lambda: lora_call(runs, f32)),
        (
            "fp8 w8a16",
            lambda: fp8_gemm.fp8_matmul_w8a16(r(4, 512), r(256, 512, dtype=fp8), r(256, dtype=f32)),
        ),
    ]


recorded: list[tuple[JITFunction, tuple[Any, ...], dict[str, Any]]] = []


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_for_gpu: run without TRITON_INTERPRET=1", file=sys.stderr)
        return 2

    def record(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        recorded.append((self, args, kwargs))

    JITFunction.run = record  # type: ignore[method-assign]
    from pagoda.kernels import pdl

    pdl.flags = lambda t: {"PDL": True, "launch_pdl": True}  # as on a Hopper GPU by default
    if sys.argv[1:] == ["--fp8-decode-ptx"]:
        print(json.dumps(fp8_decode_ptx()))
        return 0
    failures = 0
    for name, call in _launches():
        recorded.clear()
        try:
            call()
            if not recorded:
                raise RuntimeError("launched no kernel")
            for fn, args, kwargs in recorded:
                print(f"ok   {name}: {fn.__name__} ({compile_launch(fn, args, kwargs)})", flush=True)
        except Exception:
            failures += 1
            print(f"FAIL {name}:\n{traceback.format_exc()}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
