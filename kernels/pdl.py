"""Programmatic dependent launch (PDL) for the hot path's Triton kernels, on Hopper and later.

A kernel launched with PDL may start while the kernel before it in the stream is still running: its
programs are placed on the GPU as soon as every program of the one before has started (each calls
`griddepcontrol.launch_dependents` first), and wait in `griddepcontrol.wait` until that kernel has
finished and its writes are visible. What it saves is the launch gap between dependent kernels, ~1 us
each inside a CUDA graph; a batch-1 decode step of Llama-3-8B runs ~330 kernels, most of them small
(BENCHMARKS.md, "0.28 ms of gaps" of a 3.4 ms fp8 step on an H200). TensorRT-LLM launches its kernels
this way (`TRTLLM_ENABLE_PDL`).

Safety does not depend on which kernel runs before: every kernel launched with PDL calls
`await_inputs` as its first statement, so it neither reads what the kernel before wrote nor
overwrites what that kernel still reads until it has finished; and as each PDL kernel finished only
after its own wait, the chain holds back to the last ordinary launch (cuBLAS's GEMMs, PyTorch's ops).
`flags(t)` gives a launch both halves at once (the kernel's `PDL` constexpr and Triton's `launch_pdl`),
so one cannot be set without the other.

On by default on Hopper and newer; `PAGODA_PDL=0` turns it off (read once, at import; the interpreter
and CPU tensors never use it). On one H100 it took batch-1 decode from 249.6 to 259.6 tok/s in fp8 + fp8
KV (+4.0%) and from 160.6 to 166.6 in bf16 (+3.7%); a 640-request grid row moved by 0.1% (GEMMs and
attention bound it). The engine's GPU checks (parity with transformers, graphs == eager, async == in
turn) and the kernel checks pass with it (BENCHMARKS.md, 2026-12-07).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = os.environ.get("PAGODA_PDL", "1") != "0"


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def flags(t: torch.Tensor) -> dict[str, bool]:
    """A Triton launch's keyword arguments for kernels on `t`'s device: `PDL` for the kernel's
    `await_inputs`, with `launch_pdl` where it is on."""
    if not (ENABLED and t.is_cuda):
        return {"PDL": False}
    index = t.device.index
    if _supported(torch.cuda.current_device() if index is None else index):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def await_inputs(PDL: tl.constexpr):
    """The first statement of a kernel launched with `flags`: wait for the kernel before to finish,
    then let the kernel after be placed (it waits in turn)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
