"""FP8 (e4m3) linear layers: W8A8 with one scale per weight row and a dynamic scale per token.

Weights are quantized once at load, from the checkpoint's bf16/fp16 (no calibration data: a row's
scale is its absolute maximum over 448, e4m3's largest finite value). Each call quantizes the
activations per token the same way and multiplies on the tensor cores with `torch._scaled_mm`
(compute capability 8.9+: Ada, Hopper, Blackwell), accumulating in fp32 and rescaling to the model's
dtype. Elsewhere (the CPU, older GPUs) the same fp8 numbers are multiplied in float32: the reference
the tests hold the GPU path to. Embeddings, norms and the LM head stay in the model dtype.

Under tensor parallelism each rank quantizes its own shard (the scales are the shard's rows), and a
row-parallel layer keeps its all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.service.model.parallel import RowParallelLinear, TPGroup

FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
# The projections of each decoder layer; their sizes are multiples of 16, as _scaled_mm needs.
_TARGETS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [M, K] -> (fp8 [M, K], float32 scale [M, 1]) with `x ~= q * scale` row by row."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def supports_fp8_matmul(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(nn.Module):
    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, reduce: TPGroup | None = None
    ) -> None:
        """`weight` [out, in] in the model dtype, on the device it will run on. `reduce`: sum the output
        over these ranks before the bias (a row-parallel layer's shard)."""
        super().__init__()
        self.reduce = reduce
        q, scale = quantize_rows(weight)
        self.weight = nn.Parameter(q, requires_grad=False)  # [out, in] fp8
        self.weight_scale: torch.Tensor
        self.register_buffer("weight_scale", scale.view(1, -1))  # [1, out] float32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_dtype = weight.dtype
        self.use_scaled_mm = supports_fp8_matmul(weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, x.shape[-1])
        xq, x_scale = quantize_rows(rows)
        if self.use_scaled_mm:
            out = torch._scaled_mm(
                xq, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale, out_dtype=self.out_dtype
            )
        else:
            w = self.weight.float() * self.weight_scale.view(-1, 1)
            out = ((xq.float() * x_scale) @ w.t()).to(self.out_dtype)
        if self.reduce is not None:
            out = self.reduce.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], out.shape[-1])


def quantize_model_fp8(model: nn.Module, device: torch.device) -> int:
    """Swap every decoder projection for an `Fp8Linear` on `device`, one layer at a time (peak memory:
    one layer in the model dtype). The rest of the model moves to `device` as it is. Returns the count."""
    count = 0
    for layer in model.model.layers:  # type: ignore[union-attr, attr-defined]
        for path in _TARGETS:
            parent_name, name = path.split(".")
            parent = getattr(layer, parent_name)
            linear: nn.Linear = getattr(parent, name)
            bias = None if linear.bias is None else linear.bias.data.to(device)
            reduce = linear.tp if isinstance(linear, RowParallelLinear) and linear.tp.size > 1 else None
            setattr(parent, name, Fp8Linear(linear.weight.data.to(device), bias, reduce))
            count += 1
    model.to(device)
    return count
