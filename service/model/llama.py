"""The Llama family (Llama 2/3, Mistral, Qwen2) over a flattened batch with no padding.

All sequences' new tokens are concatenated into one `[num_tokens]` row; `AttentionMetadata` says
where each sequence starts and where its K/V go in the paged cache. q/k/v share one matmul
(`qkv_proj`) and gate/up another (`gate_up_proj`); the loader merges Hugging Face's separate
weights. Nothing in `forward` reads a tensor back to the host, so a CUDA graph can capture it.
Under tensor parallelism (`tp`) each rank holds its heads and slices (see `parallel`); under pipeline
parallelism (`pp`) each stage its run of layers (see `pipeline`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagoda import kernels
from pagoda.service.model.attention import AttentionMetadata, PagedAttention
from pagoda.service.model.config import ModelConfig
from pagoda.service.model.fp8 import ScaledProduct
from pagoda.service.model.parallel import (
    SINGLE_RANK,
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Shard,
    TPGroup,
    VocabParallelEmbedding,
    check_tp_size,
)
from pagoda.service.model.pipeline import SINGLE_STAGE, PPGroup


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:  # [head_dim // 2] float32
    """transformers' inverse frequencies for default, linear and llama3 rope, op for op."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    raise ValueError(f"unsupported rope type {scaling['rope_type']!r}")


def rope_cos_sin_cache(config: ModelConfig) -> torch.Tensor:  # [max_position, head_dim] float32
    """cos in the first half, sin in the second (the layout `kernels.rotary_embedding` reads)."""
    positions = torch.arange(config.max_position_embeddings, dtype=torch.int64, device="cpu").float()
    freqs = positions[:, None] * rope_inv_freq(config)[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.quantize = False  # hand the next layer fp8 rows (fp8.fuse_input_quantization)

    def forward(
        self, x: torch.Tensor | ScaledProduct, residual: torch.Tensor | None = None
    ) -> tuple[Any, torch.Tensor | None]:  # (normed, or its fp8 rows; x + residual)
        """`x`: hidden states, or an fp8 projection's product whose scales the norm applies first."""
        if isinstance(x, ScaledProduct):
            return kernels.rms_norm(
                x.acc, self.weight, self.eps, residual, self.quantize, scales=x.scales, scaled_dtype=x.dtype
            )
        return kernels.rms_norm(x, self.weight, self.eps, residual, quantize=self.quantize)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads // tp.size
        # Fewer KV heads than ranks: each rank keeps a copy of the one its query heads read.
        self.num_kv_heads = max(config.num_key_value_heads // tp.size, 1)
        first_kv_head = tp.rank * config.num_key_value_heads // tp.size
        self.head_dim = hd = config.head_dim
        self.q_size = self.num_heads * hd
        self.kv_size = self.num_kv_heads * hd
        q = Shard(0, tp.rank * self.q_size, self.q_size)
        kv = Shard(0, first_kv_head * hd, self.kv_size)
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q, kv, kv], bias=config.attention_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size, False, tp)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)
        # o_proj's and qkv_proj's fp8 scales go to the ops after them (fp8.fuse_input_quantization).
        self.defer_o_scales = False
        self.defer_qkv_scales = False

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: Any,  # [num_tokens, hidden], or its fp8 rows (fp8.QuantizedRows)
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,  # [max_position, head_dim]
    ) -> torch.Tensor | ScaledProduct:
        qkv = self.qkv_proj.product_with_scales(hidden) if self.defer_qkv_scales else self.qkv_proj(hidden)
        scaled = (qkv.scales, qkv.dtype) if isinstance(qkv, ScaledProduct) else None
        product = qkv.acc if isinstance(qkv, ScaledProduct) else qkv
        q, k, v = product.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, meta, (positions, cos_sin_cache), scaled).reshape(-1, self.q_size)
        return self.o_proj.product_with_scales(out) if self.defer_o_scales else self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        local = config.intermediate_size // tp.size
        part = Shard(0, tp.rank * local, local)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [part, part], bias=False)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, False, tp)
        self.quantize_act = False  # hand down_proj fp8 rows (fp8.fuse_input_quantization)
        self.scale_in_activation = False  # the SiLU applies gate_up_proj's fp8 scales (the same)
        self.defer_down_scales = False  # down_proj's fp8 scales go to the next norm (the same)

    def forward(self, x: Any) -> torch.Tensor | ScaledProduct:
        if self.scale_in_activation:
            h = self.gate_up_proj.product_with_scales(x)
            if isinstance(h, ScaledProduct):
                act = kernels.silu_and_mul(h.acc, True, h.scales, h.dtype)
            else:
                act = kernels.silu_and_mul(h, quantize=True)
        else:
            act = kernels.silu_and_mul(self.gate_up_proj(x), quantize=self.quantize_act)
        return self.down_proj.product_with_scales(act) if self.defer_down_scales else self.down_proj(act)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor | ScaledProduct,  # the layer before's output (a `ScaledProduct` from fp8)
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor | ScaledProduct, torch.Tensor]:
        if residual is None:  # the first layer: the embeddings
            assert isinstance(hidden, torch.Tensor)
            residual = hidden
            hidden, _ = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta, cos_sin_cache)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds: no parameters, no KV cache. It keeps its place in
    `layers`, so the local layers keep their global index in parameter names (the loader reads only
    theirs from the checkpoint)."""


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, pp: PPGroup) -> None:
        super().__init__()
        local = pp.layers(config.num_hidden_layers)
        # Stage 0's alone; None elsewhere (a tied LM head on the last stage is a copy: `LlamaForCausalLM`).
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp) if pp.is_first else None
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, tp) if i in local else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last else None


class LlamaForCausalLM(nn.Module):
    """Parameter names follow Hugging Face's, except the merged `qkv_proj` and `gate_up_proj`.

    Build it under `torch.device("meta")` and let the loader assign the weights; the rope cache is
    computed here, on the CPU, and moved with `.to(device)`. Under pipeline parallelism (`pp`) it holds
    its stage's layers, the embedding on stage 0, the final norm and the LM head on the last stage (with
    tied embeddings that stage loads the embedding's weights into its own LM head).
    """

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE_RANK, pp: PPGroup = SINGLE_STAGE) -> None:
        super().__init__()
        check_tp_size(config, tp.size)
        self.config = config
        self.tp = tp
        self.pp = pp
        self.local_layers = pp.layers(config.num_hidden_layers)
        self.model = LlamaModel(config, tp, pp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp) if pp.is_last else None
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(config), persistent=False)

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """This stage's decoder layers (all of them with one stage)."""
        return [self.model.layers[i] for i in self.local_layers]  # type: ignore[misc]

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.decoder_layers()]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """The whole model (one pipeline stage)."""
        hidden, residual = self.run_layers(positions, self.embed(input_ids), None, meta)
        return self.final_norm(hidden, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        assert self.model.embed_tokens is not None, "the embedding is pipeline stage 0's"
        return self.model.embed_tokens(input_ids)

    def run_layers(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,  # [num_tokens, hidden]: the embeddings, or the stage before's output
        residual: torch.Tensor | None,  # None: `hidden` is the embeddings
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor | ScaledProduct, torch.Tensor]:
        """This stage's decoder layers. The last one's output is a `ScaledProduct` only where it goes to
        the final norm (fp8 defers no scales across a stage boundary: `quantize_model_fp8`)."""
        out: torch.Tensor | ScaledProduct = hidden
        for layer in self.decoder_layers():
            out, residual = layer(positions, out, residual, meta, self.cos_sin_cache)
        assert residual is not None
        return out, residual

    def final_norm(self, hidden: torch.Tensor | ScaledProduct, residual: torch.Tensor) -> torch.Tensor:
        assert self.model.norm is not None, "the final norm is the last pipeline stage's"
        normed, _ = self.model.norm(hidden, residual)
        return normed

    def compute_logits(
        self, hidden: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32, or out's dtype
        """Under tensor parallelism a collective: every rank calls it on the same rows, in the same order.
        `out`: an [n, vocab] tensor the logits are written into (and returned), not a new float32 one."""
        assert self.lm_head is not None, "the LM head is the last pipeline stage's"
        return self.lm_head(hidden).float() if out is None else self.lm_head(hidden, out)
