"""FP8 (e4m3) linear layers: W8A8 with one scale per weight row and a dynamic scale per token.

Weights are quantized once at load, from the checkpoint's bf16/fp16 (no calibration data: a row's
scale is its absolute maximum over 448, e4m3's largest finite value). Each call quantizes its
activations per token (`kernels/quant.py`, one launch) and multiplies on the tensor cores with
`torch._scaled_mm`, accumulating without float32 promotion (`FAST_ACCUM`). The scales are applied one
of two ways, by row count:

- Up to `UNIT_SCALE_MAX_M` rows (decode batches): `_scaled_mm` with unit scales, which cuBLASLt
  runs at the memory limit, then `kernels.quant.scale_product` applies both scales (one launch). In
  the decoder layers the op after each projection applies them instead, in its own launch
  (`product_with_scales`, `fuse_input_quantization`): no scaling launch of its own is left. With
  row-wise scales `_scaled_mm` takes a CUTLASS kernel that reads fp8 weights at 1-2.5 TB/s at small
  M: slower than bf16 (measured on an H200, `python -m pagoda.bench.kernels_fp8`: per decode step of
  an 8B model at M=1, bf16 3.75 ms, row-wise 4.43 ms, unit scales 2.19 ms plus the scaling).
- Above it, `_scaled_mm` with the row-wise scales, which is the faster of the two at large M.

The two paths are the same arithmetic but for one bf16 rounding of the unscaled product (|acc| is at
most 448^2 x K, far inside bf16's range). The kernels run on CUDA GPUs of compute capability 8.9+
(Ada, Hopper, Blackwell); elsewhere (the CPU, older GPUs) the same numbers are multiplied in float32
by `kernels/reference.py`: the reference the tests hold the GPU paths to. Both GPU paths are
CUDA-graph capturable (no host syncs). Embeddings, norms and the LM head stay in the model dtype.

W8A16 (`skinny_max_m`: activations unquantized, a skinny Triton kernel streaming the fp8 weights,
`kernels/fp8_gemm.py`) is more accurate but measured slower than both (3.2-5.4 ms per step at M=1):
off by default, kept for the accuracy comparison (`python -m pagoda.bench.fp8_accuracy`).

Under tensor parallelism each rank quantizes its own shard (the scales are the shard's rows), and a
row-parallel layer keeps its all-reduce.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
from torch import nn

from pagoda.kernels import reference
from pagoda.service.model.parallel import RowParallelLinear, TPGroup

FP8_MAX = reference.FP8_MAX
FP8_DTYPE = torch.float8_e4m3fn
# Rows up to which a call takes the skinny W8A16 kernel (0: never; see the module docstring).
SKINNY_MAX_M = 0
# Rows up to which `_scaled_mm` runs with unit scales and the next op applies them. On an H200
# (pagoda/bench/kernels_fp8.py, 8B projections, per step) unit scales take 2.1-2.5 ms up to M=128 against
# row-wise 3.9-4.4 ms, and at M=256 3.5 ms against 4.7 (row-wise including its input quantization). In
# the engine at batch 256 the unit-scale path, its scales applied by the SiLU, the norms and the rotary,
# ran the decode step in 7.49 ms against row-wise 7.76 (offline 256 x 128/128, 22.6k against 21.7k
# tok/s). At 320-512 rows the GEMMs still favour unit scales (4.4-6.2 against 6.5-7.3 ms) but the
# scaling the next ops do grows with M; not measured there, so row-wise runs above 256.
# PAGODA_FP8_UNIT_SCALE_MAX_M overrides it (a benchmark knob).
UNIT_SCALE_MAX_M = int(os.environ.get("PAGODA_FP8_UNIT_SCALE_MAX_M", "256"))
# Hopper's fp8 tensor cores accumulate in reduced precision unless the kernel promotes partial sums to
# float32 every few k-steps; `use_fast_accum` skips that promotion, as the fp8 GEMMs of vLLM and SGLang on
# Hopper do (CUTLASS's FP8FastAccum schedules). One H100 (`python -m pagoda.bench.kernels_fp8
# --fast-accum`, BENCHMARKS.md 2026-12-06): a prefill step's projections (8192 rows, 8B shapes) 2,946 ->
# 2,718 us a layer (-8%), at 2048 rows 765 -> 691 (-10%), a decode step's neither way at 1-256 rows; the
# product's largest error over its largest value 1.5e-4 -> 3-10e-3, beside the fp8 rounding (e4m3: 2^-4
# relative) of the activations it multiplies. In the engine: 2048 / 128 x 1024 +6.9%, 1000 / 1000 x 360
# +3.9%, batch 1 unchanged; the GPU checks pass.
FAST_ACCUM = True
# The projections of each decoder layer; their sizes are multiples of 16, as _scaled_mm needs.
TARGETS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


# Activations already quantized by the op before the projection: (fp8 codes [M, in], float32 [M, 1]).
QuantizedRows = tuple[torch.Tensor, torch.Tensor]


class ScaledProduct(NamedTuple):
    """An fp8 projection's product that `torch._scaled_mm` ran with unit scales, its scales left to the
    op after it, which applies them in its own launch (as `kernels.quant.scale_product` would)."""

    acc: torch.Tensor  # [M, out] bfloat16
    row_scale: torch.Tensor  # [M, 1] float32, the activations'
    col_scale: torch.Tensor  # [1, out] float32, the weight rows'
    dtype: torch.dtype  # what the scaled product is rounded to: the layer's output dtype

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.row_scale, self.col_scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [M, K] -> (fp8 [M, K], float32 scale [M, 1]) with `x ~= q * scale` row by row."""
    return reference.quantize_fp8_rows(x)


def supports_fp8_matmul(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(nn.Module):
    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        reduce: TPGroup | None = None,
        skinny_max_m: int = SKINNY_MAX_M,
    ) -> None:
        """`weight` [out, in] in the model dtype, on the device it will run on. `reduce`: sum the output
        over these ranks before the bias (a row-parallel layer's shard). `skinny_max_m`: the most rows
        a call multiplies W8A16 (0: always W8A8)."""
        super().__init__()
        self.reduce = reduce
        q, scale = quantize_rows(weight)
        self.weight = nn.Parameter(q, requires_grad=False)  # [out, in] fp8
        self.weight_scale: torch.Tensor
        self.register_buffer("weight_scale", scale.view(1, -1))  # [1, out] float32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_dtype = weight.dtype
        self.skinny_max_m = skinny_max_m
        self.use_kernels = supports_fp8_matmul(weight.device)  # False: the float32 reference
        self.unit_scale: torch.Tensor
        self.register_buffer("unit_scale", torch.ones((), dtype=torch.float32, device=weight.device))

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:  # [M, in] or [..., in] -> [..., out]
        """`x`: activations in the model dtype, or already quantized rows (`fuses_input_quantization`)."""
        if isinstance(x, tuple):
            out, lead = self._w8a8_quantized(*x), x[0].shape[:-1]
        else:
            rows, lead = x.reshape(-1, x.shape[-1]).contiguous(), x.shape[:-1]  # a no-op for the model's
            out = self._w8a16(rows) if rows.shape[0] <= self.skinny_max_m else self._w8a8(rows)
        if self.reduce is not None:
            out = self.reduce.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*lead, out.shape[-1])

    @property
    def fuses_input_quantization(self) -> bool:
        """Whether this layer takes its input as `QuantizedRows` from the op before it (the norm, the
        activation), which quantizes in the same launch: always W8A8, never the skinny W8A16."""
        return self.skinny_max_m == 0

    @property
    def defers_scales(self) -> bool:
        """Whether `product_with_scales` may leave the scales to the next op (on a GPU, W8A8, no
        all-reduce or bias between the product and that op)."""
        return self.fuses_input_quantization and self.reduce is None and self.bias is None

    def product_with_scales(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor | ScaledProduct:
        """The product with its scales left to the caller where the unit-scale path runs: the SiLU-and-mul
        after gate_up_proj, the add + RMSNorm after o_proj and down_proj, and the rotary embedding after
        qkv_proj apply them in their own launch (`kernels.silu_and_mul` / `rms_norm` /
        `rotary_embedding`, `scales=`). Elsewhere (more rows, the float32 reference, a shard that
        reduces or a bias) the scaled output, as `forward`."""
        rows = x[0] if isinstance(x, tuple) else x
        num_rows = rows.numel() // rows.shape[-1]  # of a [..., in] input, as `forward` flattens it
        if not self.use_kernels or not self.defers_scales or num_rows > UNIT_SCALE_MAX_M:
            return self.forward(x)
        xq, x_scale = x if isinstance(x, tuple) else self._quantize(x.reshape(-1, x.shape[-1]).contiguous())
        return ScaledProduct(self._unit_scale_product(xq), x_scale, self.weight_scale, self.out_dtype)

    def _w8a16(self, rows: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        if not self.use_kernels:
            return reference.fp8_matmul_w8a16(rows, self.weight, self.weight_scale)
        from pagoda.kernels.fp8_gemm import fp8_matmul_w8a16

        return fp8_matmul_w8a16(rows, self.weight, self.weight_scale)

    def _w8a8(self, rows: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        return self._w8a8_quantized(*self._quantize(rows))

    def _quantize(self, rows: torch.Tensor) -> QuantizedRows:  # [M, in] -> per-row fp8 codes and scales
        if not self.use_kernels:
            return reference.quantize_fp8_rows(rows)
        from pagoda.kernels.quant import quantize_fp8_rows

        return quantize_fp8_rows(rows)

    def _unit_scale_product(self, xq: torch.Tensor) -> torch.Tensor:  # [M, out] bfloat16, scales not applied
        one = self.unit_scale
        return torch._scaled_mm(
            xq, self.weight.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM
        )

    def _w8a8_quantized(self, xq: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:  # [M, out]
        if not self.use_kernels:
            w = self.weight.float() * self.weight_scale.view(-1, 1)
            return ((xq.float() * x_scale) @ w.t()).to(self.out_dtype)
        from pagoda.kernels.quant import scale_product

        if xq.shape[0] <= UNIT_SCALE_MAX_M:
            return scale_product(self._unit_scale_product(xq), x_scale, self.weight_scale, self.out_dtype)
        return torch._scaled_mm(
            xq,
            self.weight.t(),
            scale_a=x_scale,
            scale_b=self.weight_scale,
            out_dtype=self.out_dtype,
            use_fast_accum=FAST_ACCUM,
        )


def run_cublaslt_without_workspace() -> None:
    """Have cuBLASLt, which runs `torch._scaled_mm`, pick its kernels without a workspace, unless the
    user set `CUBLASLT_WORKSPACE_SIZE` (KiB; read at cuBLASLt's first use, so call this before it).

    With a workspace, cuBLASLt runs gate_up_proj at 256 rows as a dynamically scheduled persistent
    kernel that zeroes a tile counter with a memset node first (5.5 us of idle a layer) and splits
    down_proj's K at one row; without one it takes a static kernel and no split, faster in both places
    (H200, `python -m pagoda.bench.kernels_fp8 --gemm-kernels`: gate_up at 256 rows 53.0 -> 51.5 us,
    down at 1 row 20.3 -> 18.3 us). In the engine (8B-shaped): batch-1 decode 3.48 -> 3.35 ms a
    step; with an fp8 KV cache, offline 256 x 128/128 23,208 -> 23,505 tok/s (decode idle 0.53 -> 0.44
    ms a step). bf16 engines gained nothing from it (BENCHMARKS.md), so only fp8 ones set it.
    Process-wide: any other GEMM torch hands cuBLASLt runs without one too (in an fp8 model the bf16
    one is the LM head's; the figures above include it)."""
    os.environ.setdefault("CUBLASLT_WORKSPACE_SIZE", "0")


def quantize_model_fp8(model: nn.Module, device: torch.device) -> int:
    """Swap every decoder projection for an `Fp8Linear` on `device`, one layer at a time (peak memory:
    one layer in the model dtype). The rest of the model moves to `device` as it is. Returns the count."""
    count = 0
    layers = model.decoder_layers()  # type: ignore[operator]  # this pipeline stage's
    for layer in layers:
        for path in TARGETS:
            parent_name, name = path.split(".")
            parent = getattr(layer, parent_name)
            linear: nn.Linear = getattr(parent, name)
            bias = None if linear.bias is None else linear.bias.data.to(device)
            reduce = linear.tp if isinstance(linear, RowParallelLinear) and linear.tp.size > 1 else None
            setattr(parent, name, Fp8Linear(linear.weight.data.to(device), bias, reduce))
            count += 1
        fuse_input_quantization(layer)
    if not model.pp.is_last:  # type: ignore[union-attr]
        # The stage's last down_proj hands its output to the next stage, not to a norm here: a plain
        # tensor, its scales applied (a ScaledProduct cannot cross the boundary).
        layers[-1].mlp.defer_down_scales = False
    model.to(device)
    return count


def fuse_input_quantization(layer: nn.Module) -> None:
    """Let the ops in front of a decoder layer's fp8 projections hand them quantized rows: the two
    norms (before qkv_proj and gate_up_proj) and the SiLU-and-mul (before down_proj), which also applies
    gate_up_proj's scales (`Fp8Linear.product_with_scales`). o_proj quantizes its own input, the
    attention output; its scales and down_proj's go to the add + RMSNorm after each (the next layer's
    for down_proj, or the final norm), and qkv_proj's to the rotary embedding that writes the KV cache.
    Undone where a projection is not an `Fp8Linear` that takes them."""
    attn: Any = layer.self_attn
    mlp: Any = layer.mlp

    def takes(linear: object) -> bool:
        return isinstance(linear, Fp8Linear) and linear.fuses_input_quantization

    layer.input_layernorm.quantize = takes(attn.qkv_proj)  # type: ignore[union-attr]
    layer.post_attention_layernorm.quantize = takes(mlp.gate_up_proj)  # type: ignore[union-attr]
    mlp.quantize_act = takes(mlp.down_proj)
    # The SiLU-and-mul that quantizes for down_proj also scales gate_up_proj's product.
    mlp.scale_in_activation = takes(mlp.gate_up_proj) and mlp.quantize_act
    # o_proj's and down_proj's products go to an add + RMSNorm, which scales them; qkv_proj's to the
    # rotary embedding that writes the KV cache.
    attn.defer_qkv_scales = isinstance(attn.qkv_proj, Fp8Linear) and attn.qkv_proj.defers_scales
    attn.defer_o_scales = isinstance(attn.o_proj, Fp8Linear) and attn.o_proj.defers_scales
    mlp.defer_down_scales = isinstance(mlp.down_proj, Fp8Linear) and mlp.down_proj.defers_scales
