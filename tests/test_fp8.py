"""FP8 projections (W8A8; W8A16 for few rows when asked): the layer against a float matmul, the model
against its unquantized self, and the engine end to end with `quantization="fp8"` (the CPU runs the
float32 emulation that the GPU's kernels are checked against in `pagoda.bench.gpu_check`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pagoda.kernels import reference
from pagoda.service.engine.config import EngineConfig
from pagoda.service.engine.llm_engine import LLMEngine
from pagoda.service.model.fp8 import (
    FP8_DTYPE,
    Fp8Linear,
    ScaledProduct,
    fuse_input_quantization,
    quantize_model_fp8,
    quantize_rows,
    run_cublaslt_without_workspace,
)
from pagoda.service.model.loader import load_model
from pagoda.service.sampling_params import SamplingParams


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_quantize_rows_round_trip() -> None:
    x = torch.randn(8, 256) * torch.logspace(-2, 2, 8).view(-1, 1)  # rows of very different scale
    q, scale = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (8, 1)
    back = q.float() * scale
    assert rel_l2(back, x) < 0.04  # e4m3: 3 mantissa bits, at most 1/16 per element
    torch.testing.assert_close(back.abs().amax(dim=-1), x.abs().amax(dim=-1))  # row maxima survive


def test_fp8_linear_matches_float_matmul() -> None:
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 64), torch.randn(96), torch.randn(5, 3, 64)
    layer = Fp8Linear(weight, bias)
    assert layer.weight.dtype == FP8_DTYPE and not layer.use_kernels
    out = layer(x)
    assert out.shape == (5, 3, 96)
    assert rel_l2(out, x @ weight.t() + bias) < 0.06


def test_fp8_linear_picks_w8a16_up_to_skinny_max_m() -> None:
    torch.manual_seed(1)
    weight = torch.randn(48, 256)
    skinny = 16  # off by default (slower on an H200); the accuracy comparison turns it on
    layer = Fp8Linear(weight, None, skinny_max_m=skinny)
    few, many = torch.randn(skinny, 256), torch.randn(skinny + 1, 256)
    # Few rows (up to skinny): unquantized activations times the fp8 weights; many: both quantized.
    for rows in (few, few[:3]):
        assert torch.equal(layer(rows), reference.fp8_matmul_w8a16(rows, layer.weight, layer.weight_scale))
    xq, x_scale = quantize_rows(many)
    w8a8 = (xq.float() * x_scale) @ (layer.weight.float() * layer.weight_scale.view(-1, 1)).t()
    torch.testing.assert_close(layer(many), w8a8)
    # Activation rounding is W8A8's extra error: the same rows come out closer to float W8A16.
    always_w8a8 = Fp8Linear(weight, None, skinny_max_m=0)
    assert rel_l2(layer(few), few @ weight.t()) < 0.7 * rel_l2(always_w8a8(few), few @ weight.t())


def test_quantized_model_logits_stay_close(llama_ckpt: Path, paged_runner: type) -> None:
    ref, _ = load_model(llama_ckpt, dtype=torch.float32)
    quant, _ = load_model(llama_ckpt, dtype=torch.float32)
    assert quantize_model_fp8(quant, torch.device("cpu")) == 2 * 4
    prompt = list(range(100, 140))
    a = paged_runner(ref).step({0: prompt})[0]
    b = paged_runner(quant).step({0: prompt})[0]
    assert not torch.equal(a, b)  # really quantized
    # Hidden size 64 is noisy for fp8; real models (4096) land far closer (see gpu_check).
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    assert cosine.mean() > 0.99 and cosine.min() > 0.97
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.75  # a wrong scale gives ~0


def test_fused_input_quantization_changes_no_logit(
    llama_ckpt: Path, paged_runner: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The norms and the SiLU hand the fp8 projections quantized rows: the same numbers as each
    projection quantizing its own input, to the bit (wiring; the kernels are in tests/kernels)."""
    model, _ = load_model(llama_ckpt, dtype=torch.float32)
    quantize_model_fp8(model, torch.device("cpu"))
    layer = model.model.layers[0]
    assert layer.input_layernorm.quantize and layer.post_attention_layernorm.quantize
    assert layer.mlp.quantize_act and layer.mlp.scale_in_activation
    prompt = list(range(100, 130))
    # Which projections quantize their own input (a tensor arrives) and which take fused rows (a tuple).
    own_inputs: list[bool] = []
    forward = Fp8Linear.forward

    def counting(self: Fp8Linear, x: object) -> torch.Tensor:
        own_inputs.append(not isinstance(x, tuple))
        return forward(self, x)  # type: ignore[arg-type]

    monkeypatch.setattr(Fp8Linear, "forward", counting)
    fused = paged_runner(model).step({0: prompt})[0]
    num_layers = len(model.model.layers)
    assert sum(own_inputs) == num_layers and len(own_inputs) == 4 * num_layers  # o_proj alone
    for layer in model.model.layers:
        layer.input_layernorm.quantize = layer.post_attention_layernorm.quantize = False
        layer.mlp.quantize_act = layer.mlp.scale_in_activation = False
    own_inputs.clear()
    assert torch.equal(fused, paged_runner(model).step({0: prompt})[0])
    assert all(own_inputs) and len(own_inputs) == 4 * num_layers
    for layer in model.model.layers:  # a W8A16 projection takes unquantized rows: nothing fuses
        layer.mlp.down_proj.skinny_max_m = 1 << 30
        fuse_input_quantization(layer)
        assert not layer.mlp.quantize_act and layer.input_layernorm.quantize
        assert not layer.mlp.scale_in_activation


def test_deferred_scales_reach_the_silu_and_the_norms(
    llama_ckpt: Path, paged_runner: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU, up to UNIT_SCALE_MAX_M rows, every projection returns its product unscaled with its
    scales: qkv_proj's to the rotary embedding that writes the KV cache, gate_up_proj's to the
    SiLU-and-mul that quantizes for down_proj, o_proj's and down_proj's to the add + RMSNorm after them
    (the next layer's, or the final norm). That product is
    `torch._scaled_mm`'s, which needs a GPU: a stand-in (the float32 product of the codes) holds the
    wiring here; the kernels are checked in tests/kernels, the GPU path by `gpu_check`."""
    model, _ = load_model(llama_ckpt, dtype=torch.float32)
    quantize_model_fp8(model, torch.device("cpu"))
    layers = model.model.layers
    attns = [layer.self_attn for layer in layers]
    assert all(a.defer_qkv_scales and a.defer_o_scales for a in attns)
    assert all(layer.mlp.defer_down_scales for layer in layers)
    prompt = list(range(100, 130))
    scaled = paged_runner(model).step({0: prompt})[0]
    deferred_by: list[Fp8Linear] = []

    def unscaled_product_gpu_stand_in(self: Fp8Linear, x: object) -> ScaledProduct:
        deferred_by.append(self)
        xq, x_scale = x if isinstance(x, tuple) else reference.quantize_fp8_rows(x)  # type: ignore[arg-type]
        return ScaledProduct(xq.float() @ self.weight.float().t(), x_scale, self.weight_scale, self.out_dtype)

    monkeypatch.setattr(Fp8Linear, "product_with_scales", unscaled_product_gpu_stand_in)
    deferred = paged_runner(model).step({0: prompt})[0]
    expected = [
        p
        for layer in layers
        for p in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    ]
    assert deferred_by == expected
    torch.testing.assert_close(deferred, scaled, rtol=1e-4, atol=1e-4)  # float32, other order
    # A shard that all-reduces (or adds a bias) after the product scales it itself.
    down = layers[0].mlp.down_proj
    monkeypatch.setattr(
        down, "bias", torch.nn.Parameter(torch.zeros(down.weight.shape[0]), requires_grad=False)
    )
    fuse_input_quantization(layers[0])
    assert not layers[0].mlp.defer_down_scales and layers[0].self_attn.defer_o_scales


@pytest.fixture
def scaled_mm_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """`torch._scaled_mm` needs a GPU: a stand-in (the float32 product of the scaled codes, rounded to
    `out_dtype`) records each call's keyword arguments here. The GPU's own product is checked by
    `gpu_check`'s fp8 layer check."""
    calls: list[dict] = []

    def scaled_mm_gpu_stand_in(a: torch.Tensor, b: torch.Tensor, **kw: object) -> torch.Tensor:
        calls.append(kw)
        sa, sb = kw["scale_a"], kw["scale_b"]
        return ((a.float() * sa) @ (b.float() * sb)).to(kw["out_dtype"])  # type: ignore[operator,arg-type]

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_gpu_stand_in)
    return calls


def test_gpu_products_ask_for_fast_accumulation(
    scaled_mm_calls: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both GPU products (unit scales, row-wise) call `torch._scaled_mm` with `use_fast_accum` (FAST_ACCUM),
    with the scales each path owes it."""
    from pagoda.service.model import fp8

    calls = scaled_mm_calls
    layer = Fp8Linear(torch.randn(32, 64, dtype=torch.bfloat16), None)
    layer.use_kernels = True
    xq, x_scale = quantize_rows(torch.randn(3, 64))
    unit = layer._unit_scale_product(xq)
    monkeypatch.setattr(fp8, "UNIT_SCALE_MAX_M", 0)  # 3 rows take the row-wise product
    rowwise = layer._w8a8_quantized(xq, x_scale)
    assert [c["use_fast_accum"] for c in calls] == [True, True]
    assert calls[0]["scale_a"].item() == calls[0]["scale_b"].item() == 1.0
    assert calls[1]["scale_a"] is x_scale and calls[1]["scale_b"] is layer.weight_scale
    torch.testing.assert_close(
        (unit.float() * x_scale * layer.weight_scale), rowwise.float(), rtol=2e-2, atol=1e-2
    )


def test_gpu_path_takes_unit_scales_up_to_unit_scale_max_m(
    scaled_mm_calls: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU, up to UNIT_SCALE_MAX_M rows (of a [2, 3, in] input: 6) `product_with_scales` leaves the
    scales to the next op and `forward` applies them with `scale_product`; past it both take the
    row-wise product. The same numbers either way. The Triton quantization and `scale_product` need a GPU
    or the interpreter: float32 stand-ins here (the kernels are checked in tests/kernels)."""
    from pagoda.kernels import quant
    from pagoda.service.model import fp8

    monkeypatch.setattr(quant, "scale_product", reference.scale_product)
    layer = Fp8Linear(torch.randn(32, 64, dtype=torch.bfloat16), None)
    layer.use_kernels = True
    monkeypatch.setattr(layer, "_quantize", reference.quantize_fp8_rows)  # the Triton quantization's stand-in
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(fp8, "UNIT_SCALE_MAX_M", 6)
    deferred = layer.product_with_scales(x)
    assert isinstance(deferred, ScaledProduct) and deferred.acc.shape == (6, 32)
    scaled = layer(x)
    assert scaled.shape == (2, 3, 32) and all(c["scale_a"].numel() == 1 for c in scaled_mm_calls)
    monkeypatch.setattr(fp8, "UNIT_SCALE_MAX_M", 5)
    rowwise, rowwise_forward = layer.product_with_scales(x), layer(x)
    assert isinstance(rowwise, torch.Tensor) and rowwise.shape == (2, 3, 32)
    assert [c["scale_a"].shape for c in scaled_mm_calls[2:]] == [(6, 1), (6, 1)]
    want = (deferred.acc.float() * deferred.row_scale * deferred.col_scale).view(2, 3, 32)
    for got in (scaled, rowwise, rowwise_forward):
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=1e-2)


def test_fp8_matmul_needs_a_cuda_gpu_of_compute_capability_8_9(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ada (8.9) and Hopper (9.0) multiply fp8 on the tensor cores; Ampere (8.6) and the CPU emulate."""
    from pagoda.service.model.fp8 import supports_fp8_matmul

    capability = [(8, 9)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    found = {}
    for cap in ((8, 6), (8, 9), (9, 0)):
        capability[0] = cap
        found[cap] = supports_fp8_matmul(torch.device("cuda"))
    assert found == {(8, 6): False, (8, 9): True, (9, 0): True}
    assert not supports_fp8_matmul(torch.device("cpu"))


def test_engine_serves_fp8(llama_ckpt: Path) -> None:
    config = EngineConfig(
        model=str(llama_ckpt), dtype="float32", quantization="fp8", kv_cache_memory_bytes=4 << 20
    )
    engine = LLMEngine(config)
    layer = engine.runner.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, Fp8Linear) and isinstance(layer.self_attn.qkv_proj, Fp8Linear)
    engine.add_request("q", list(range(10, 50)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 8
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_accuracy_script_schemes_swap_projections_both_ways(llama_ckpt: Path) -> None:
    from pagoda.bench.fp8_accuracy import W8A16, Scheme, apply_scheme

    model, _ = load_model(llama_ckpt, dtype=torch.float32)
    layers = model.model.layers
    before = [layer.mlp.down_proj for layer in layers]
    originals: dict = {}
    apply_scheme(model, originals, Scheme("w8a16, down kept", W8A16, frozenset({"mlp.down_proj"})))
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8) == 3 * len(layers) and all(m.skinny_max_m == W8A16 for m in fp8)
    assert [layer.mlp.down_proj for layer in layers] == before
    apply_scheme(model, originals, Scheme("bf16", None))
    assert not any(isinstance(m, Fp8Linear) for m in model.modules()) and len(originals) == 4 * len(layers)


def test_paged_attention_scales_a_product_only_where_it_rotates() -> None:
    """An unscaled qkv product handed to attention without the rotary launch would reach the cache
    unscaled: refused."""
    from pagoda.service.model.attention import AttentionMetadata, PagedAttention

    attn = PagedAttention(2, 1, 8)
    q, k = torch.zeros(1, 2, 8), torch.zeros(1, 1, 8)
    i32 = torch.int32
    meta = AttentionMetadata(torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=i32),
                             torch.ones(1, dtype=i32), torch.tensor([0, 1], dtype=i32), 1, 1,
                             decode_rows=True)  # fmt: skip
    scales = (torch.ones(1, 1), torch.ones(1, 32))
    with pytest.raises(ValueError, match="rotary launch only"):
        attn(q, k, k, meta, None, (scales, torch.float32))


def test_cublaslt_runs_without_workspace_unless_the_user_chose_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    run_cublaslt_without_workspace()
    assert os.environ["CUBLASLT_WORKSPACE_SIZE"] == "0"
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "4096")
    run_cublaslt_without_workspace()
    assert os.environ["CUBLASLT_WORKSPACE_SIZE"] == "4096"
