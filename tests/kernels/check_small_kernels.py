"""write_kv, rms_norm, rotary_embedding, silu_and_mul: the Triton kernels against `reference.py`.

Run under TRITON_INTERPRET=1 (tests/test_kernels_interpret.py does) or on a GPU. Outputs are
poisoned (NaN) first so an unwritten element fails. Tolerances: float32 1e-5; float16/bfloat16 one
rounding step of the dtype (the kernels compute in float32 and round once where PyTorch may round
twice).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from pagoda.kernels import reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA GPU", allow_module_level=True)

import pagoda.kernels as kernels  # noqa: E402
from pagoda.kernels import activation  # noqa: E402
from pagoda.kernels.activation import silu_and_mul  # noqa: E402
from pagoda.kernels.kv_cache import cache_view, write_kv  # noqa: E402
from pagoda.kernels.norm import rms_norm  # noqa: E402
from pagoda.kernels.quant import quantize_fp8_rows, scale_product  # noqa: E402
from pagoda.kernels.rotary import rotary_embedding  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Each test draws the same inputs whatever ran before it (the files share one interpreter)."""
    torch.manual_seed(0)


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(dtype)


def test_dispatch_runs_triton_when_forced() -> None:
    assert os.environ.get("PAGODA_KERNELS") != "triton" or kernels.use_triton(torch.zeros(1))


# --- write_kv ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_heads", [1, 3, 8])
def test_write_kv(dtype: torch.dtype, num_kv_heads: int) -> None:
    num_blocks, block_size, head_dim, num_tokens = 40, 16, 32, 23
    key = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype)
    value = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype)
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    # Distinct slots in high blocks, some mid-block, and padding (-1) that must be skipped.
    slots = torch.randperm(num_blocks * block_size)[:num_tokens] + 0
    slots[[3, 7, 20]] = -1
    slots[0] = num_blocks * block_size - 1
    slots = slots.to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, value, k_ref, v_ref, slots)
    write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_write_kv_strided_inputs_and_dtype_cast() -> None:
    num_tokens, num_kv_heads, head_dim = 9, 2, 64
    qkv = randn(num_tokens, 3 * num_kv_heads, head_dim)
    key, value = qkv[:, :num_kv_heads], qkv[:, num_kv_heads : 2 * num_kv_heads]
    kv = randn(8, 16, 2, num_kv_heads, head_dim, dtype=torch.float16)
    k_cache, v_cache = kv[:, :, 0], kv[:, :, 1]
    slots = torch.tensor([5, 17, 18, -1, 100, 127, 0, 64, -5], device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, value, k_ref, v_ref, slots)
    write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 3.0)], ids=["unit", "scaled"])
@pytest.mark.parametrize("v_token_major", [False, True], ids=["V slot-major", "V token-major"])
def test_write_kv_fp8_cache(dtype: torch.dtype, scales: tuple[float, float], v_token_major: bool) -> None:
    """Every code as reference.write_kv (PyTorch's cast, ties to even): values that round up into the
    next binade, subnormals, zeros and values past +-448 that saturate; V also into the engine's
    token-major layout for an fp8 cache (`kv_cache.cache_view`)."""
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 24, 16, 2, 64, 40
    key = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype) * 4
    value = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype) / 64
    key[0, 0, :6] = torch.tensor([1e4, -1e4, 1.9531, -1.9609, 0.0, 3e-3])
    value[1, 1, :4] = torch.tensor([30.0, -30.0, 1e-6, -0.0])
    fp8 = torch.float8_e4m3fn
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE).to(fp8)
    v_cache = k_cache.clone()
    slots = (torch.randperm(num_blocks * block_size)[:num_tokens]).to(DEVICE)
    slots[5] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    if v_token_major:
        flat = torch.zeros(num_blocks, block_size * num_kv_heads * head_dim, device=DEVICE).to(fp8)
        v_cache = cache_view(flat, block_size, num_kv_heads, head_dim, token_major=True)
    reference.write_kv(key, value, k_ref, v_ref, slots, *scales)
    write_kv(key, value, k_cache, v_cache, slots, *scales)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    assert k_cache.float().abs().max() == 448.0  # saturated, not NaN
    written = k_cache.view(-1, num_kv_heads, head_dim)[slots[slots >= 0]].float() * scales[0]
    expected = key[slots >= 0].float().clamp(-448 * scales[0], 448 * scales[0])
    torch.testing.assert_close(written, expected, rtol=0.0625, atol=scales[0] * 2**-9)


@pytest.mark.parametrize("cache_dtype", [*DTYPES, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("path", ["write_kv", "rotary", "reference"])
def test_cache_writes_are_finite(cache_dtype: torch.dtype, path: str) -> None:
    """NaN is written as 0 and +-inf as the cache dtype's largest value (+-448 in fp8), by every path that
    writes the cache: attention reads slots past a context's end as they are
    (`DecodeConfig.finite_cache`), where a NaN a request left would reach later requests."""
    num_tokens, num_kv_heads, head_dim, block_size = 3, 2, 32, 16
    dtype = torch.float32 if cache_dtype == torch.float8_e4m3fn else cache_dtype
    key = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype)
    key[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    value = key.flip(0)  # the bad values in the last token's V
    k_cache = torch.zeros(2, block_size, num_kv_heads, head_dim, device=DEVICE).to(cache_dtype)
    v_cache = k_cache.clone()
    slots = torch.tensor([3, 17, 30], device=DEVICE)
    if path == "rotary":  # position 0 rotates by nothing: K as it came
        rotary_embedding(
            torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE), key.clone(), key,
            cos_sin_cache(8, head_dim), (value, k_cache, v_cache, slots, 1.0, 1.0),
        )  # fmt: skip
    else:
        (reference.write_kv if path == "reference" else write_kv)(key, value, k_cache, v_cache, slots)
    big = 448.0 if cache_dtype == torch.float8_e4m3fn else torch.finfo(cache_dtype).max
    for cache, token in ((k_cache, 0), (v_cache, num_tokens - 1)):
        row = cache.view(-1, num_kv_heads, head_dim)[slots[token], 0].float()
        assert row[:3].tolist() == [0.0, big, -big]
        assert cache.float().isfinite().all()


def test_write_kv_refuses_bad_shapes() -> None:
    key = randn(4, 2, 32)
    cache = randn(8, 16, 2, 32)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(key, key, cache, cache, torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="k_cache"):
        write_kv(
            key,
            key,
            randn(8, 16, 4, 32),
            randn(8, 16, 4, 32),
            torch.zeros(4, dtype=torch.int64, device=DEVICE),
        )
    slots = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="v_cache"):
        write_kv(key, key, cache.to(torch.float8_e4m3fn), cache, slots)
    with pytest.raises(ValueError, match="must be positive"):
        write_kv(key, key, cache, cache.clone(), slots, k_scale=0.0)


# --- rms_norm ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 200])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    x = randn(7, hidden, dtype=dtype)
    weight = (1 + 0.1 * randn(hidden)).to(dtype)
    residual = randn(7, hidden, dtype=dtype) if with_residual else None
    out = torch.full_like(x, float("nan"))
    res_out = torch.full_like(x, float("nan")) if with_residual else None
    got, got_res = rms_norm(x, weight, 1e-6, residual, out=out, residual_out=res_out)
    expected, expected_res = reference.rms_norm(x, weight, 1e-6, residual)
    tol = TOL[dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    if with_residual:
        torch.testing.assert_close(got_res, expected_res, atol=0, rtol=0)
    else:
        assert got_res is None


def _codes_match(got: tuple, expected: tuple) -> None:
    assert got[0].dtype == torch.float8_e4m3fn and got[1].shape == (got[0].shape[0], 1)
    torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)
    assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quantized(dtype: torch.dtype, with_residual: bool) -> None:
    """The fused norm's fp8 rows are the unfused pipeline's (the norm's stored output quantized by
    `quantize_fp8_rows`), to the bit in the interpreter, and close to the reference's."""
    x = randn(9, 320, dtype=dtype) * 2
    weight = (1 + 0.1 * randn(320)).to(dtype)
    residual = randn(9, 320, dtype=dtype) if with_residual else None
    got, got_res = rms_norm(x, weight, 1e-6, residual, quantize=True)
    normed, res = rms_norm(x, weight, 1e-6, residual)
    unfused = quantize_fp8_rows(normed)
    if INTERPRET:
        _codes_match(got, unfused)
    else:  # compiled, the two kernels may sum a row's squares in different orders: 1 ulp of inv_rms
        torch.testing.assert_close(got[1], unfused[1], rtol=1e-6, atol=0)
        dequant = got[0].float() * got[1]
        torch.testing.assert_close(
            dequant, unfused[0].float() * unfused[1], rtol=0.13, atol=2 * 2**-9 * got[1].max()
        )
    if with_residual:
        assert torch.equal(got_res, res)
    # One e4m3 step (12.5% near a power of two) from the reference's codes at most.
    ref_q, ref_scale = reference.quantize_fp8_rows(reference.rms_norm(x, weight, 1e-6, residual)[0])
    torch.testing.assert_close(got[0].float() * got[1], ref_q.float() * ref_scale, rtol=0.13, atol=1e-3)
    with pytest.raises(ValueError, match="out must not"):
        rms_norm(x, weight, 1e-6, out=torch.empty_like(x), quantize=True)


@pytest.mark.parametrize("scaled_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_applies_fp8_product_scales(
    scaled_dtype: torch.dtype, quantize: bool, with_residual: bool
) -> None:
    """An unscaled fp8 product (o_proj's, down_proj's; bf16 on the GPU, float32 in the interpreter) with
    its row and column scales: the same bits as `scale_product` into `scaled_dtype` and then the norm."""
    acc_dtype = torch.float32 if INTERPRET else torch.bfloat16
    acc = (randn(6, 320) * 300).to(acc_dtype)
    row_scale = (torch.rand(6, 1, device=DEVICE) + 0.5) * 1e-3
    col_scale = (torch.rand(1, 320, device=DEVICE) + 0.5) * 1e-2
    weight = (1 + 0.1 * randn(320)).to(scaled_dtype)
    residual = randn(6, 320, dtype=scaled_dtype) if with_residual else None
    got, got_res = rms_norm(
        acc,
        weight,
        1e-6,
        residual,
        quantize=quantize,
        scales=(row_scale, col_scale),
        scaled_dtype=scaled_dtype,
    )
    scaled = scale_product(acc, row_scale, col_scale, scaled_dtype)
    expected, expected_res = rms_norm(scaled, weight, 1e-6, residual, quantize=quantize)
    if quantize:
        _codes_match(got, expected)
    else:
        assert got.dtype == scaled_dtype
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    if with_residual:
        assert got_res is not None and got_res.dtype == scaled_dtype
        torch.testing.assert_close(got_res, expected_res, atol=0, rtol=0)
    with pytest.raises(ValueError, match="scales are float32"):
        rms_norm(acc, weight, 1e-6, residual, scales=(row_scale, col_scale[:, :7]), scaled_dtype=scaled_dtype)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(acc, weight, 1e-6, randn(6, 320, dtype=torch.float32), scales=(row_scale, col_scale),
                 scaled_dtype=scaled_dtype)  # fmt: skip


def test_rms_norm_float32_weight_and_strided_rows() -> None:
    x = randn(5, 256, dtype=torch.float16)[:, :128]
    weight = randn(128)
    got, _ = rms_norm(x, weight, 1e-5)
    expected, _ = reference.rms_norm(x, weight, 1e-5)
    assert got.dtype == expected.dtype == torch.float32
    # The normed value is rounded to float16 before the float32 weight: where the kernel's float32 sum of
    # squares differs from PyTorch's in its last bit, that rounding can land one float16 step away
    # (7e-4 relative was seen once in an unseeded run).
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=TOL[torch.float16])


def test_rms_norm_refuses_bad_shapes() -> None:
    with pytest.raises(ValueError, match="weight"):
        rms_norm(randn(3, 8), randn(9), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(randn(3, 8), randn(8), 1e-6, randn(3, 8, dtype=torch.float16))


# --- silu_and_mul ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 100, 1500])
def test_silu_and_mul(dtype: torch.dtype, d: int) -> None:
    x = randn(6, 2 * d, dtype=dtype) * 3
    out = torch.full((6, d), float("nan"), dtype=dtype, device=DEVICE)
    got = silu_and_mul(x, out=out)
    tol = TOL[dtype]
    torch.testing.assert_close(got, reference.silu_and_mul(x), atol=tol, rtol=tol)


@pytest.fixture(params=["per row", "tiled"])
def silu_layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The quantizing SiLU both ways: one program per row, or column tiles over the GPU."""
    limit = 1 << 30 if request.param == "tiled" else -1
    monkeypatch.setattr(activation, "TILED_MAX_ROWS", limit)
    monkeypatch.setattr(activation, "SCALED_TILED_MAX_ROWS", limit)
    return str(request.param)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 1500, 17000])
def test_silu_and_mul_quantized(dtype: torch.dtype, d: int, silu_layout: str) -> None:
    """Rows held in registers, rows past 16k columns (whose amax and store passes loop), and the same
    rows in 1024-column tiles (a partial last tile at 1500 and 17000)."""
    x = randn(5, 2 * d, dtype=dtype) * 3
    x[1, 7] = 40.0  # one large gate: the row's scale follows it
    _codes_match(silu_and_mul(x, quantize=True), quantize_fp8_rows(silu_and_mul(x)))


@pytest.mark.parametrize("scaled_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 17000])
def test_silu_and_mul_applies_fp8_product_scales(scaled_dtype: torch.dtype, d: int, silu_layout: str) -> None:
    """An unscaled fp8 gate-up product (bf16 on the GPU, float32 in the interpreter) with its row and
    column scales: the same codes as `scale_product` into `scaled_dtype` followed by the fused kernel."""
    acc_dtype = torch.float32 if INTERPRET else torch.bfloat16
    acc = (randn(4, 2 * d) * 300).to(acc_dtype)  # |acc| up to ~448^2 x K in the model
    row_scale = (torch.rand(4, 1, device=DEVICE) + 0.5) * 1e-3
    col_scale = (torch.rand(1, 2 * d, device=DEVICE) + 0.5) * 1e-2
    col_scale[0, 3] = 0.5  # one large gate column
    got = silu_and_mul(acc, quantize=True, scales=(row_scale, col_scale), scaled_dtype=scaled_dtype)
    scaled = scale_product(acc, row_scale, col_scale, scaled_dtype)
    _codes_match(got, silu_and_mul(scaled, quantize=True))
    ref = reference.quantize_fp8_rows(
        reference.silu_and_mul(reference.scale_product(acc, row_scale, col_scale, scaled_dtype))
    )
    torch.testing.assert_close(got[0].float() * got[1], ref[0].float() * ref[1], rtol=0.13, atol=1e-3)
    with pytest.raises(ValueError, match="scales apply with quantize=True"):
        silu_and_mul(acc, scales=(row_scale, col_scale))
    with pytest.raises(ValueError, match="scales apply with quantize=True"):
        silu_and_mul(acc, quantize=True, scales=(row_scale, col_scale[:, :d]))


def test_silu_and_mul_refuses_odd_width() -> None:
    with pytest.raises(ValueError, match="2 \\* d"):
        silu_and_mul(randn(3, 7))


# --- rotary_embedding -----------------------------------------------------------------------------------


def cos_sin_cache(max_position: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float().to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 1, 64), (8, 8, 32), (6, 2, 48)])
def test_rotary_embedding(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    num_tokens, max_position = 11, 4096
    cache = cos_sin_cache(max_position, head_dim)
    positions = torch.randint(0, max_position, (num_tokens,), device=DEVICE)
    positions[0] = max_position - 1
    # q and k as views into one fused projection, as the engine produces them.
    qkv = randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype)
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    q_ref, k_ref = q.clone(), k.clone()
    v_before = qkv[:, num_heads + num_kv_heads :].clone()
    reference.rotary_embedding(positions, q_ref, k_ref, cache)
    rotary_embedding(positions, q, k, cache)
    tol = TOL[dtype]
    torch.testing.assert_close(q, q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k, k_ref, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], v_before), "v must not be touched"
    assert math.isfinite(q.float().abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fp8_cache", [False, True], ids=["cache in dtype", "fp8 cache"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 1, 64), (8, 8, 32), (6, 3, 128)])
@pytest.mark.parametrize("v_token_major", [False, True], ids=["V slot-major", "V token-major"])
def test_rotary_embedding_writes_kv(
    dtype: torch.dtype, fp8_cache: bool, num_heads: int, num_kv_heads: int, head_dim: int, v_token_major: bool
) -> None:
    """Rotary with `kv_write`: q, k and both caches exactly as rotary_embedding then write_kv, in the
    engine's layout (q, k, v views into one projection; the caches views into one tensor, V in either
    of `kv_cache.cache_view`'s layouts)."""
    num_tokens, num_blocks, block_size = 13, 6, 16
    cache = cos_sin_cache(512, head_dim)
    positions = torch.randint(0, 512, (num_tokens,), device=DEVICE)
    qkv = randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype) * 3
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    flat = torch.zeros(2, num_blocks, block_size * num_kv_heads * head_dim, device=DEVICE)
    flat = flat.to(torch.float8_e4m3fn if fp8_cache else dtype)
    flat_ref = flat.clone()

    def caches(storage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            cache_view(storage[0], block_size, num_kv_heads, head_dim, token_major=False),
            cache_view(storage[1], block_size, num_kv_heads, head_dim, token_major=v_token_major),
        )

    slots = torch.randperm(num_blocks * block_size)[:num_tokens].to(DEVICE)
    slots[4] = -1  # graph padding: rotated, not written
    scales = (0.5, 2.0) if fp8_cache else (1.0, 1.0)
    qkv_ref = qkv.clone()
    q_ref, k_ref, v_ref = qkv_ref.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    rotary_embedding(positions, q_ref, k_ref, cache)
    write_kv(k_ref, v_ref, *caches(flat_ref), slots, *scales)
    rotary_embedding(positions, q, k, cache, (v, *caches(flat), slots, *scales))
    assert torch.equal(qkv, qkv_ref)
    as_bits = (lambda t: t.view(torch.uint8)) if fp8_cache else (lambda t: t)
    assert torch.equal(as_bits(flat), as_bits(flat_ref))
    if v_token_major:  # and where the reference puts V
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        expected = torch.zeros(shape, dtype=flat.dtype, device=DEVICE)
        reference.write_kv(k_ref, v_ref, expected.clone(), expected, slots, *scales)
        assert torch.equal(as_bits(caches(flat)[1]), as_bits(expected))
    assert flat.float().abs().sum() > 0  # something was written
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_embedding(positions, q, k, cache, (v, *caches(flat), slots[:3], *scales))


@pytest.mark.parametrize("scaled_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fp8_cache", [False, True], ids=["cache in dtype", "fp8 cache"])
def test_rotary_applies_fp8_qkv_scales(scaled_dtype: torch.dtype, fp8_cache: bool) -> None:
    """q, k, v as column ranges of an unscaled fp8 qkv product (bf16 on the GPU, float32 in the
    interpreter) with its row and column scales: q_out and both caches are the bits of `scale_product`
    into `scaled_dtype`, then rotary with the cache write."""
    num_tokens, num_heads, num_kv_heads, head_dim, num_blocks, block_size = 9, 4, 2, 64, 4, 16
    acc_dtype = torch.float32 if INTERPRET else torch.bfloat16
    columns = (num_heads + 2 * num_kv_heads) * head_dim
    acc = (randn(num_tokens, columns) * 300).to(acc_dtype)
    row_scale = (torch.rand(num_tokens, 1, device=DEVICE) + 0.5) * 1e-3
    col_scale = (torch.rand(1, columns, device=DEVICE) + 0.5) * 1e-2
    cache = cos_sin_cache(256, head_dim)
    positions = torch.randint(0, 256, (num_tokens,), device=DEVICE)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens].to(DEVICE)
    slots[2] = -1
    kv = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE)
    kv = kv.to(torch.float8_e4m3fn if fp8_cache else scaled_dtype)
    kv_ref = kv.clone()

    def views(x: torch.Tensor) -> list[torch.Tensor]:
        return list(x.view(num_tokens, -1, head_dim).split([num_heads, num_kv_heads, num_kv_heads], dim=1))

    scaled = scale_product(acc, row_scale, col_scale, scaled_dtype)
    q_ref, k_ref, v_ref = views(scaled)
    rotary_embedding(positions, q_ref, k_ref, cache, (v_ref, kv_ref[0], kv_ref[1], slots, 0.5, 2.0))
    q, k, v = views(acc)
    q_out = torch.full(q.shape, float("nan"), device=DEVICE).to(scaled_dtype)
    before = acc.clone()
    rotary_embedding(positions, q, k, cache, (v, kv[0], kv[1], slots, 0.5, 2.0),
                     scales=(row_scale, col_scale), scaled_dtype=scaled_dtype, q_out=q_out)  # fmt: skip
    assert torch.equal(q_out, q_ref)
    assert torch.equal(
        kv.view(torch.uint8) if fp8_cache else kv, kv_ref.view(torch.uint8) if fp8_cache else kv_ref
    )
    assert torch.equal(acc, before)  # the product itself is not written
    short = (row_scale, col_scale[:, :5])
    with pytest.raises(ValueError, match="scales are float32"):
        rotary_embedding(positions, q, k, cache, (v, kv[0], kv[1], slots, 0.5, 2.0),
                         scales=short, scaled_dtype=scaled_dtype, q_out=q_out)  # fmt: skip
    with pytest.raises(ValueError, match="go with kv_write"):
        rotary_embedding(
            positions, q, k, cache, scales=(row_scale, col_scale), scaled_dtype=scaled_dtype, q_out=q_out
        )


@pytest.mark.parametrize("scaled", [False, True], ids=["q, k, v in dtype", "unscaled fp8 product"])
@pytest.mark.parametrize("path", ["triton", "reference"])
def test_rotary_hands_back_the_rotated_k_and_v(
    scaled: bool, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kv_out`: the rotated K and the V, as the cache gets them but in q's dtype (`scaled_dtype` for an fp8
    product), beside the cache write; `q_out` without scales takes the rotated q and leaves q as it was.
    The Triton kernel and the dispatcher's reference path (the CPU engine's) alike; refused without
    `kv_write` or in another shape or dtype."""
    monkeypatch.setenv("PAGODA_KERNELS", path)
    num_tokens, num_heads, num_kv_heads, head_dim = 7, 4, 2, 32
    dtype = torch.float16
    columns = (num_heads + 2 * num_kv_heads) * head_dim
    acc = randn(num_tokens, columns, dtype=torch.float32 if scaled else dtype) * (300 if scaled else 2)
    row_scale = (torch.rand(num_tokens, 1, device=DEVICE) + 0.5) * 1e-3
    col_scale = (torch.rand(1, columns, device=DEVICE) + 0.5) * 1e-2
    cache = cos_sin_cache(64, head_dim)
    positions = torch.randint(0, 64, (num_tokens,), device=DEVICE)
    slots = torch.randperm(4 * 16)[:num_tokens].to(DEVICE)
    kv = torch.zeros(2, 4, 16, num_kv_heads, head_dim, device=DEVICE, dtype=torch.float8_e4m3fn)

    def views(x: torch.Tensor) -> list[torch.Tensor]:
        return list(x.view(num_tokens, -1, head_dim).split([num_heads, num_kv_heads, num_kv_heads], dim=1))

    want = scale_product(acc, row_scale, col_scale, dtype) if scaled else acc.clone()
    q_ref, k_ref, v_ref = views(want)
    reference.rotary_embedding(positions, q_ref, k_ref, cache)
    q, k, v = views(acc)
    before = acc.clone()
    q_out, k_out, v_out = (torch.full(t.shape, float("nan"), dtype=dtype, device=DEVICE) for t in (q, k, v))
    extra = {"scales": (row_scale, col_scale), "scaled_dtype": dtype} if scaled else {}
    write = (v, kv[0], kv[1], slots, 1.0, 1.0)
    kernels.rotary_embedding(positions, q, k, cache, write, q_out=q_out, kv_out=(k_out, v_out), **extra)
    for got, ref in ((q_out, q_ref), (k_out, k_ref), (v_out, v_ref)):
        assert torch.equal(got, ref)
    assert torch.equal(q, before.view(num_tokens, -1, head_dim)[:, :num_heads])  # q_out took it
    assert kv.float().abs().sum() > 0  # the cache was written too
    with pytest.raises(ValueError, match=r"goe?s? with kv_write"):
        kernels.rotary_embedding(positions, q, k, cache, q_out=q_out, kv_out=(k_out, v_out), **extra)
    if path == "triton":
        with pytest.raises(ValueError, match="kv_out must be"):
            kernels.rotary_embedding(positions, q, k, cache, write, q_out=q_out, kv_out=(k_out[:3], v_out),
                                     **extra)  # fmt: skip


def test_rotary_refuses_wrong_cache_width() -> None:
    q, k = randn(2, 4, 64), randn(2, 1, 64)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_embedding(torch.zeros(2, dtype=torch.int64, device=DEVICE), q, k, cos_sin_cache(16, 32))


def test_dispatchers_survive_kernel_imports() -> None:
    """Importing the kernel submodules must not shadow the package's dispatch functions."""
    x = randn(4, 64)
    kernels.silu_and_mul(x)
    kernels.rms_norm(x, randn(64), 1e-6)
    q, k = randn(4, 2, 64), randn(4, 1, 64)
    kernels.rotary_embedding(torch.arange(4, device=DEVICE), q, k, cos_sin_cache(8, 64))
    cache = randn(2, 16, 1, 64)
    kernels.write_kv(k, k, cache, cache.clone(), torch.arange(4, device=DEVICE))
    loc = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[1]], dtype=torch.int32, device=DEVICE)
    kernels.paged_attention(q, cache, cache, table, lens, loc, 0.125, 4, 4)
    for name in kernels.__all__:
        assert callable(getattr(kernels, name)) and not isinstance(getattr(kernels, name), type(kernels)), (
            name
        )


# --- argmax -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
def test_argmax_is_torchs_first_index_of_the_maximum(dtype: torch.dtype, rows: int) -> None:
    from pagoda.kernels.argmax_rows import BLOCK, argmax

    cols = 2 * BLOCK + 77  # three chunks, the last ragged
    x = randn(rows, cols + 3, dtype=dtype)[:, :cols]  # a row stride wider than the row
    # Ties: the same maximum in two chunks (row 0), twice in one chunk (row 1); one at the last column
    # (row 2), past which the masked tail must not win; a row of -inf (row 3, index 0); equal rows (4).
    x[0, [5, BLOCK + 9]] = 50.0
    if rows > 1:
        x[1, [BLOCK + 30, BLOCK + 31]] = 50.0
        x[2, cols - 1] = 50.0
        x[3] = float("-inf")
        x[4] = 0.0
    got = argmax(x)
    assert got.dtype == torch.int64
    assert got.tolist() == x.argmax(dim=1).tolist()
    if rows > 1:
        assert got.tolist()[:5] == [5, BLOCK + 30, cols - 1, 0, 0]


def test_argmax_of_one_chunk_of_nan_and_of_no_rows() -> None:
    from pagoda.kernels.argmax_rows import BLOCK, argmax

    x = randn(3, 100)
    assert argmax(x).tolist() == x.argmax(dim=1).tolist()
    nan = randn(2, BLOCK + 10)
    nan[0, [7, BLOCK + 3]] = float("nan")  # the first NaN, as torch ranks NaN above all
    nan[1] = float("nan")
    assert argmax(nan).tolist() == nan.argmax(dim=1).tolist() == [7, 0]
    assert argmax(x[:0]).shape == (0,)
    with pytest.raises(ValueError, match="contiguous"):
        argmax(x.t())


# --- fill_seeded_noise ------------------------------------------------------------------------------


@pytest.mark.parametrize("with_uniform", [False, True])
def test_seeded_noise_is_the_references_hash(with_uniform: bool) -> None:
    from pagoda.kernels.seeded_noise import fill_seeded_noise

    vocab = 2 * 1024 + 37  # three column blocks, the last ragged
    # Rows 3, 0, 1; keys with the top bit of either half set (signed int32 patterns read as unsigned).
    keys = [[3, 5, 9], [0, -7, 2**31 - 1], [1, -(2**31), -1]]
    seeded = torch.tensor(keys, dtype=torch.int32, device=DEVICE)
    noise = torch.full((5, vocab), float("nan"), device=DEVICE)
    expected = noise.clone()
    uniform = torch.full((5,), float("nan"), device=DEVICE) if with_uniform else None
    expected_uniform = None if uniform is None else uniform.clone()
    fill_seeded_noise(noise, seeded, uniform)
    reference.fill_seeded_noise(expected, seeded, expected_uniform)
    torch.testing.assert_close(noise, expected, rtol=2e-6, atol=0, equal_nan=True)  # -log's last bit
    assert noise[[2, 4]].isnan().all()  # rows not asked for: untouched
    if uniform is not None:
        assert expected_uniform is not None
        torch.testing.assert_close(uniform, expected_uniform, rtol=0, atol=0, equal_nan=True)
