"""FP8 (e4m3) linear layers: weights with one scale per row, two ways to multiply by them.

Weights are quantized once at load, from the checkpoint's bf16/fp16 (no calibration data: a row's
scale is its absolute maximum over 448, e4m3's largest finite value). A call then takes one of two
paths by its row count, on every device alike:

- Up to `skinny_max_m` rows (decode batches), W8A16: the activations stay in the model dtype and a
  skinny Triton kernel (`kernels/fp8_gemm.py`) streams the fp8 weights once, upcasting them in
  registers. One launch, and more accurate than W8A8 (no activation rounding).
- Above it, W8A8: the activations are quantized per token (`kernels/quant.py`, one launch) and
  multiplied on the tensor cores with `torch._scaled_mm`, accumulating in fp32 and rescaling to the
  model's dtype.

The kernels run on CUDA GPUs of compute capability 8.9+ (Ada, Hopper, Blackwell); elsewhere (the
CPU, older GPUs) the same numbers are multiplied in float32 by `kernels/reference.py`: the reference
the tests hold the GPU paths to. Both GPU paths are CUDA-graph capturable (no host syncs). Embeddings,
norms and the LM head stay in the model dtype.

Under tensor parallelism each rank quantizes its own shard (the scales are the shard's rows), and a
row-parallel layer keeps its all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.kernels import reference
from pagoda.service.model.parallel import RowParallelLinear, TPGroup

FP8_MAX = reference.FP8_MAX
FP8_DTYPE = torch.float8_e4m3fn
# Rows up to which a call takes the skinny W8A16 kernel rather than quantize + torch._scaled_mm.
# Untuned: the skinny kernel costs the same up to its 16-row tile and reads the weights again per
# 16 rows above it. `python -m pagoda.kernels.bench_fp8` times both paths per row count to set it.
SKINNY_MAX_M = 16
# The projections of each decoder layer; their sizes are multiples of 16, as _scaled_mm needs.
TARGETS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # a no-op for the model's activations
        out = self._w8a16(rows) if rows.shape[0] <= self.skinny_max_m else self._w8a8(rows)
        if self.reduce is not None:
            out = self.reduce.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], out.shape[-1])

    def _w8a16(self, rows: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        if not self.use_kernels:
            return reference.fp8_matmul_w8a16(rows, self.weight, self.weight_scale)
        from pagoda.kernels.fp8_gemm import fp8_matmul_w8a16

        return fp8_matmul_w8a16(rows, self.weight, self.weight_scale)

    def _w8a8(self, rows: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        if not self.use_kernels:
            xq, x_scale = reference.quantize_fp8_rows(rows)
            w = self.weight.float() * self.weight_scale.view(-1, 1)
            return ((xq.float() * x_scale) @ w.t()).to(self.out_dtype)
        from pagoda.kernels.quant import quantize_fp8_rows

        xq, x_scale = quantize_fp8_rows(rows)
        return torch._scaled_mm(
            xq, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale, out_dtype=self.out_dtype
        )


def quantize_model_fp8(model: nn.Module, device: torch.device) -> int:
    """Swap every decoder projection for an `Fp8Linear` on `device`, one layer at a time (peak memory:
    one layer in the model dtype). The rest of the model moves to `device` as it is. Returns the count."""
    count = 0
    for layer in model.model.layers:  # type: ignore[union-attr, attr-defined]
        for path in TARGETS:
            parent_name, name = path.split(".")
            parent = getattr(layer, parent_name)
            linear: nn.Linear = getattr(parent, name)
            bias = None if linear.bias is None else linear.bias.data.to(device)
            reduce = linear.tp if isinstance(linear, RowParallelLinear) and linear.tp.size > 1 else None
            setattr(parent, name, Fp8Linear(linear.weight.data.to(device), bias, reduce))
            count += 1
    model.to(device)
    return count
