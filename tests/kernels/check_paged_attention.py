"""Paged attention: the Triton kernels against `reference.paged_attention`.

Run under TRITON_INTERPRET=1 (tests/test_kernels_interpret.py does) or on a GPU. Tolerances are
against the reference computed in float64 on the same inputs: float32 1e-4 (IEEE dots), float16 and
bfloat16 the rounding of the probabilities to the input dtype before the P @ V product.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from pagoda.kernels import kv_cache, reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA GPU", allow_module_level=True)

from pagoda.kernels.attention import (  # noqa: E402
    LONG_PREFILL_TOKENS,
    DecodeConfig,
    PrefillConfig,
    _default_configs,
    compile_decode_variants,
    decode_split_counts,
    decode_splits,
    long_prefill_config,
    paged_attention,
)

DEVICE = "cpu" if INTERPRET else "cuda"
# The triton 3.9 interpreter computes bf16 tl.dot wrongly; bf16 is checked on the GPU only.
# The interpreter runs each program in numpy, the same control flow for every dtype: there float16 alone
# (inputs cast, the float32 accumulators and the casts back all exercised) halves the CI's slowest
# check (3 min on 2 cores); on a GPU every dtype runs, bfloat16 too.
DTYPES = [torch.float16] if INTERPRET else [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 1,
    head_dim: int = 32,
    block_size: int = 16,
    num_blocks: int = 64,
    dtype: torch.dtype = torch.float32,
    high_block_ids: bool = False,
    seed: int = 0,
) -> dict:
    """A flattened batch over a randomly permuted (non-contiguous) block table."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    total = sum(blocks_per_seq)
    if high_block_ids:
        num_blocks = max(num_blocks, 4 * total + 1000)
        ids = num_blocks - 1 - torch.randperm(2 * total, generator=gen)[:total]
    else:
        num_blocks = max(num_blocks, total)
        ids = torch.randperm(num_blocks, generator=gen)[:total]
    # Padding entries point at block 0: what is read there must never reach the output.
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = ids[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    batch = dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=query_start_loc,
    )
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    batch.update(scale=head_dim**-0.5, max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    return batch


def decode_config(**fields) -> DecodeConfig:
    """Interpreter-sized decode tiles, splitting down to one tile unless told otherwise."""
    return DecodeConfig(**{"tile_n": 16, "num_warps": 1, "num_stages": 1, "min_partition": 16, **fields})


def check(batch: dict, **configs) -> None:
    expected = reference.paged_attention(
        **{k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}
    )
    out = torch.full_like(batch["q"], float("nan"))
    got = paged_attention(**batch, out=out, **configs)
    assert got is out
    valid = torch.cat(
        [
            torch.arange(int(a), int(b))
            for a, b in zip(batch["query_start_loc"][:-1], batch["query_start_loc"][1:], strict=True)
        ]
    )
    got, expected = got[valid.to(got.device)].double(), expected[valid.to(got.device)]
    assert not got.isnan().any(), "unwritten or NaN output"
    tol = TOL[batch["q"].dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_block_boundaries(dtype: torch.dtype, group: int) -> None:
    # Contexts ending exactly on, just past and just before a block boundary, and a single token.
    seq_lens = [16, 17, 32, 33, 15, 1, 47]
    batch = make_batch([1] * len(seq_lens), seq_lens, num_heads=2 * group, num_kv_heads=2, dtype=dtype)
    check(batch)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_decode_splits(dtype: torch.dtype, num_splits: int) -> None:
    # One long row and several short ones: some splits of the short rows are empty.
    seq_lens = [150, 3, 16, 70]
    batch = make_batch([1] * 4, seq_lens, num_heads=8, num_kv_heads=2, dtype=dtype, high_block_ids=True)
    check(batch, decode_config=decode_config(num_splits=num_splits))
    if batch["q"].is_cuda:  # the engine's tiles
        check(batch, decode_config=DecodeConfig(num_splits=num_splits))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("max_seq_len", [4096, 131072])
@pytest.mark.parametrize("partition_by", ["seq_len", "max_seq_len"])
def test_decode_graph_max_seq_len(dtype: torch.dtype, max_seq_len: int, partition_by: str) -> None:
    # Inside CUDA graphs max_seq_len is the model's context length, not the batch's: each sequence
    # cuts its own context (at min_partition 32, 150 tokens in 5 splits, 3 in one) and the rest exit.
    seq_lens = [150, 3, 16, 70, 33]
    batch = make_batch([1] * 5, seq_lens, num_heads=8, num_kv_heads=2, dtype=dtype, high_block_ids=True)
    batch["max_seq_len"] = max_seq_len
    check(batch)
    check(batch, decode_config=decode_config(min_partition=32, partition_by=partition_by))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [8, 64])
def test_decode_mixed_split_counts(dtype: torch.dtype, num_splits: int) -> None:
    # Contexts off the 16-token tile, from 1 to 500 tokens: at 8 splits and min_partition 32 they use
    # 1, 1, 2, 3, 7 and 8 splits (partitions 32, 32, 32, 32, 32, 64), at 64 splits up to 16.
    seq_lens = [1, 17, 33, 95, 200, 500]
    batch = make_batch([1] * 6, seq_lens, num_heads=4, num_kv_heads=2, dtype=dtype, high_block_ids=True)
    batch["max_seq_len"] = 8192
    check(batch, decode_config=decode_config(num_splits=num_splits, min_partition=32))
    # min_partition rounds up to 32
    check(batch, decode_config=decode_config(num_splits=num_splits, min_partition=20))


def test_split_choice() -> None:
    # An H200's 132 SMs, Llama-3-8B's 8 kv heads. Batch 1 fills a wave of 528 programs whatever
    # max_seq_len the graph was captured with; the device then uses 18 of the 66 splits at 1.1k tokens.
    assert decode_splits(DecodeConfig(), 1, 8, 131072, 132) == (66, 64)
    assert decode_splits(DecodeConfig(), 1, 8, 1100, 132) == (18, 64)
    assert decode_splits(DecodeConfig(), 64, 8, 131072, 132) == (1, 64)
    assert decode_splits(DecodeConfig(num_splits=3, min_partition=100), 64, 8, 131072, 132) == (3, 128)
    # The old scheme: one partition from max_seq_len, 2048 tokens at 128k (a 1.1k context in one split).
    old = DecodeConfig(partition_by="max_seq_len", min_partition=256)
    assert decode_splits(old, 1, 8, 131072, 132) == (64, 2048)
    assert decode_splits(old, 1, 8, 1100, 132) == (5, 256)
    with pytest.raises(ValueError, match="num_splits"):
        DecodeConfig(num_splits=0)


def test_without_decode_rows_the_decode_kernels_are_not_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    """`decode_rows=False` (an eager step of prompt chunks only): the prefill kernel alone writes every
    row, the output the reference's; where a row does decode, the flag is what launches its kernel (its
    output is left unwritten without it)."""
    from pagoda.kernels import attention

    prompts = make_batch([5, 17, 2], [5, 40, 9], num_heads=4, num_kv_heads=2, dtype=torch.float16)
    mixed = make_batch([1, 17, 1], [30, 40, 9], num_heads=4, num_kv_heads=2, dtype=torch.float16)
    launched: list[str] = []
    for name in ("_decode_kernel", "_reduce_kernel", "_prefill_kernel"):
        kernel = getattr(attention, name)

        class Recorded:
            def __getitem__(self, grid, kernel=kernel, name=name):  # type: ignore[no-untyped-def]
                launched.append(name)
                return kernel[grid]

        monkeypatch.setattr(attention, name, Recorded())
    check(prompts, decode_config=decode_config(num_splits=2), decode_rows=False)
    assert launched == ["_prefill_kernel"]
    check(mixed, decode_config=decode_config(num_splits=2))  # decode_rows=True by default
    assert launched[1:] == ["_decode_kernel", "_reduce_kernel", "_prefill_kernel"]
    out = torch.full_like(mixed["q"], float("nan"))
    paged_attention(**mixed, out=out, decode_rows=False)
    assert out[0].isnan().all() and out[-1].isnan().all() and not out[1:18].isnan().any()


def variant(num_splits: int) -> tuple[int, bool, bool]:
    """What Triton compiles the decode and reduce kernels for: the reduce's SPLITS_PAD, and num_splits
    specialized on being 1 and on divisibility by 16."""
    return 1 << (num_splits - 1).bit_length(), num_splits == 1, num_splits % 16 == 0


def test_decode_split_counts_cover_every_variant_a_batch_can_launch() -> None:
    # An H200's 132 SMs, 8 kv heads, a 128k context: one sequence takes up to 66 splits.
    counts = decode_split_counts(DecodeConfig(), 8, 131072, 132)
    assert counts == [1, 2, 3, 5, 9, 16, 17, 32, 33, 48, 65]
    # (8 kv heads on 34 SMs: 17 splits at most, the one count of its variant.)
    for kv_heads, max_len, sms in (
        (8, 131072, 132),
        (2, 4096, 132),
        (8, 1100, 78),
        (1, 40000, 16),
        (8, 9000, 34),
    ):
        counts = decode_split_counts(DecodeConfig(), kv_heads, max_len, sms)
        assert len({variant(n) for n in counts}) == len(counts)  # one launch a variant
        launched = {variant(n) for n in counts}
        for num_seqs in (1, 2, 3, 5, 8, 13, 64, 256):
            for seq_len in (1, 63, 64, 65, 700, 1100, 4096, 9000, max_len):
                n, _ = decode_splits(DecodeConfig(), num_seqs, kv_heads, min(seq_len, max_len), sms)
                assert variant(n) in launched, (kv_heads, max_len, sms, num_seqs, seq_len, n)


def test_compile_decode_variants_launches_each_count_and_writes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pagoda.kernels import attention

    b = make_batch([1], [40], num_heads=4, num_kv_heads=2, dtype=torch.float16)
    launched: list[tuple[int | None, int, list[int]]] = []

    def spy(q, k_cache, v_cache, block_tables, seq_lens, starts, *args, **kw):  # type: ignore[no-untyped-def]
        launched.append((kw["decode_config"].num_splits, q.shape[0], seq_lens.tolist()))
        return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, starts, *args, **kw)

    monkeypatch.setattr(attention, "paged_attention", spy)
    caches = b["k_cache"].clone(), b["v_cache"].clone()
    counts = compile_decode_variants(b["q"], b["k_cache"], b["v_cache"], 300)
    cfg = DecodeConfig() if b["q"].is_cuda else attention._INTERPRETER_DECODE
    assert counts == decode_split_counts(cfg, 2, 300, attention._num_sms(b["q"].device)) and len(counts) > 3
    assert launched == [(n, 1, [300]) for n in counts]  # one query token over the longest context
    assert torch.equal(b["k_cache"], caches[0]) and torch.equal(b["v_cache"], caches[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_whole_prompts(dtype: torch.dtype, group: int) -> None:
    query_lens = [16, 17, 40, 2]
    batch = make_batch(query_lens, query_lens, num_heads=group, num_kv_heads=1, dtype=dtype)
    check(batch)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_prefill_starting_mid_block(dtype: torch.dtype) -> None:
    # Cached prefixes of 20 and 7 tokens (mid-block), chunks ending just past / exactly on a boundary.
    query_lens = [13, 25, 30]
    seq_lens = [33, 32, 64 + 30]
    batch = make_batch(query_lens, seq_lens, num_heads=8, num_kv_heads=2, dtype=dtype, high_block_ids=True)
    check(batch)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_decode_and_prefill(dtype: torch.dtype, group: int) -> None:
    query_lens = [1, 13, 1, 1, 25, 1, 0, 3]
    seq_lens = [33, 33, 16, 17, 32, 100, 0, 50]
    batch = make_batch(query_lens, seq_lens, num_heads=2 * group, num_kv_heads=2, dtype=dtype)
    check(batch, decode_config=decode_config(num_splits=3))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_head_dims_and_block_sizes(head_dim: int, block_size: int) -> None:
    batch = make_batch(
        [1, 9, 1], [40, 50, 65], num_heads=4, num_kv_heads=1, head_dim=head_dim, block_size=block_size,
        dtype=torch.float16,
    )  # fmt: skip
    check(batch)


def test_bigger_tiles_and_odd_group() -> None:
    # Group of 3 query heads per kv head (padded to 4 rows), tiles spanning several blocks.
    batch = make_batch([1, 20, 1], [80, 60, 33], num_heads=6, num_kv_heads=2, dtype=torch.float16)
    check(
        batch,
        decode_config=decode_config(tile_n=32, num_splits=2),
        prefill_config=PrefillConfig(block_m=32, tile_n=32, num_warps=1, num_stages=1),
    )


def test_non_contiguous_q_and_cache() -> None:
    batch = make_batch([1, 12], [30, 40], num_heads=4, num_kv_heads=2, dtype=torch.float16)
    q = batch["q"]
    qkv = torch.randn(q.shape[0], q.shape[1] * 2, q.shape[2], dtype=q.dtype, device=q.device)
    qkv[:, : q.shape[1]] = q
    batch["q"] = qkv[:, : q.shape[1]]  # token stride covers k and v as a fused projection does
    kv = torch.stack([batch["k_cache"], batch["v_cache"]], dim=2)  # [blocks, block_size, 2, kv_heads, dim]
    batch["k_cache"], batch["v_cache"] = kv[:, :, 0], kv[:, :, 1]
    assert not batch["q"].is_contiguous() and not batch["k_cache"].is_contiguous()
    check(batch)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("widen", ["cast", "v"])
def test_fp8_cache_with_scales(dtype: torch.dtype, num_splits: int, widen: str) -> None:
    """An fp8 cache holding K / k_scale and V / v_scale: decode rows (split and not), a chunked prefill
    and a whole prompt in one batch, against the reference on the same fp8 codes. `widen` picks how
    compiled kernels widen the tiles (the interpreter always casts); on a GPU the engine's tile size
    runs as well."""
    batch = make_batch([1, 1, 20, 37], [40, 7, 20, 90], num_heads=8, num_kv_heads=2, dtype=dtype, seed=3)
    k_scale, v_scale = 0.25, 2.0
    for name, scale in (("k_cache", k_scale), ("v_cache", v_scale)):
        batch[name] = (batch[name].float() * 3 / scale).to(torch.float8_e4m3fn)
    batch.update(k_scale=k_scale, v_scale=v_scale)
    check(batch, decode_config=decode_config(num_splits=num_splits, fp8_widen=widen))
    if batch["q"].is_cuda:
        check(batch, decode_config=DecodeConfig(tile_n=128, num_splits=num_splits, fp8_widen=widen))


def _poison_unwritten_slots(batch: dict, name: str) -> None:
    """NaN in every slot no step wrote: each sequence's last block past its context, and every block no
    sequence holds (block 0 among them, which masked block-table reads fall back to)."""
    cache = batch[name]
    block_size = cache.shape[1]
    tables = batch["block_tables"]
    for s, ctx in enumerate(batch["seq_lens"].tolist()):
        if ctx % block_size:
            cache[int(tables[s, (ctx - 1) // block_size]), ctx % block_size :] = float("nan")
    held = {
        int(tables[s, b])
        for s, ctx in enumerate(batch["seq_lens"].tolist())
        for b in range(-(-ctx // block_size))
    }
    free = [b for b in range(cache.shape[0]) if b not in held]
    assert 0 in free
    cache[free] = float("nan")


@pytest.mark.parametrize("fp8", [False, True], ids=["float16", "fp8"])
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_token_major_v_cache(fp8: bool, block_size: int, num_splits: int) -> None:
    """V in the token-major layout, as the engine keeps an fp8 V cache: decode rows (split and not),
    chunked and whole prefills, with blocks smaller than, equal to and larger than a tile; unwritten
    slots hold NaN and must not reach the output."""
    batch = make_batch(
        [1, 1, 20, 37, 1], [40, 7, 20, 90, 70], num_heads=8, num_kv_heads=2, dtype=torch.float16,
        block_size=block_size, seed=5, high_block_ids=True,
    )  # fmt: skip
    for name in ("k_cache", "v_cache"):
        _poison_unwritten_slots(batch, name)
    if fp8:
        for name in ("k_cache", "v_cache"):
            batch[name] = (batch[name].float() * 2).to(torch.float8_e4m3fn)
        batch.update(k_scale=0.5, v_scale=0.5)
    v_cache = kv_cache.token_major_copy(batch["v_cache"])
    assert kv_cache.is_token_major(v_cache)
    torch.testing.assert_close(v_cache.float(), batch["v_cache"].float(), rtol=0, atol=0, equal_nan=True)
    batch["v_cache"] = v_cache
    prefill = PrefillConfig(block_m=16, tile_n=16, num_warps=1, num_stages=1)
    if block_size == 4:  # runs of min(block, tile) slots: the two must divide one another
        with pytest.raises(ValueError, match="divide one another"):
            paged_attention(
                **batch, decode_config=decode_config(tile_n=16), prefill_config=PrefillConfig(tile_n=6)
            )
    # NaN past the ends: the masked last tile (`finite_cache=False`); test_finite_cache_* the engine's.
    masked = {"num_splits": num_splits, "finite_cache": False}
    check(batch, decode_config=decode_config(**masked), prefill_config=prefill)
    if not INTERPRET:  # 16-slot tiles already meet blocks smaller than, equal to and larger than a tile
        check(batch, decode_config=decode_config(tile_n=32, **masked), prefill_config=prefill)
    if batch["q"].is_cuda:
        check(batch, decode_config=DecodeConfig(**masked))
        check(batch, decode_config=DecodeConfig(finite_cache=False))


def _fill_unwritten_slots(batch: dict, name: str, value: float) -> None:
    """`value` in every slot `_poison_unwritten_slots` would make NaN."""
    batch[name] = batch[name].clone()
    _poison_unwritten_slots(batch, name)
    batch[name] = torch.nan_to_num(batch[name], nan=value)


@pytest.mark.parametrize("fp8", [False, True], ids=["float16", "fp8-token-major"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_finite_cache_reads_past_the_context(fp8: bool, num_splits: int) -> None:
    """`DecodeConfig.finite_cache`: the last, partial tile of a context is read unmasked, its scores
    masked. Large finite values in the unwritten slots (each context's last block, and block 0, which
    masked block-table reads fall back to) must not reach the output; NaN there does, which shows those
    slots are read: the engine's cache holds none (`kv_cache.write_kv` writes finite values only)."""
    seq_lens = [40, 7, 70, 33, 16]
    batch = make_batch(
        [1] * len(seq_lens), seq_lens, num_heads=8, num_kv_heads=2, dtype=torch.float16, seed=11,
        high_block_ids=True,
    )  # fmt: skip
    big = 400.0 if fp8 else 3e4
    for name in ("k_cache", "v_cache"):
        _fill_unwritten_slots(batch, name, big)
        if fp8:
            batch[name] = batch[name].to(torch.float8_e4m3fn)
    if fp8:
        batch["v_cache"] = kv_cache.token_major_copy(batch["v_cache"])
    finite = decode_config(num_splits=num_splits, finite_cache=True)
    check(batch, decode_config=finite)
    check(batch, decode_config=decode_config(tile_n=32, num_splits=num_splits, finite_cache=True))
    if batch["q"].is_cuda:
        check(batch, decode_config=DecodeConfig(num_splits=num_splits, finite_cache=True))
    if fp8 and INTERPRET:  # the interpreter widens an e4m3 NaN to a number (480): the GPU's gives NaN
        return
    _poison_unwritten_slots(batch, "v_cache")  # NaN past the ends: read as it is now
    got = paged_attention(**batch, decode_config=finite)
    ragged = [s for s, n in enumerate(seq_lens) if n % 16]
    assert got[ragged].isnan().any(dim=-1).all(), "a partial tile's slots past the context were not read"
    assert not got[[s for s in range(len(seq_lens)) if s not in ragged]].isnan().any()


def test_finite_cache_is_the_default_over_an_fp8_cache_only() -> None:
    """The engine's fp8 cache reads its last tiles whole (measured faster); a 16-bit cache keeps the
    masked tail (measured 9% slower at 64 x 1,024 read whole)."""
    q = torch.zeros(1, 4, 128, dtype=torch.bfloat16, device=DEVICE)
    cache = torch.zeros(2, 16, 1, 128, dtype=torch.bfloat16, device=DEVICE)
    for dtype, token_major, finite in ((torch.float8_e4m3fn, True, True), (torch.float8_e4m3fn, False, True),
                                       (torch.bfloat16, False, False)):  # fmt: skip
        decode, _ = _default_configs(q, cache.to(dtype), token_major)
        assert decode.finite_cache is finite


def test_long_prefill_config_choice() -> None:
    """Chunks of LONG_PREFILL_TOKENS or more take the tiles measured on 8k chunks, on a GPU, at head
    dim 128 and 16-bit q only (the cases the sweep ran)."""
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    assert long_prefill_config("cuda", bf16, 128, bf16) == PrefillConfig(256, 64, 8, 2)
    assert long_prefill_config("cuda", torch.float16, 128, fp8) == PrefillConfig(128, 64, 4, 2)
    assert long_prefill_config("cpu", bf16, 128, bf16) is None
    assert long_prefill_config("cuda", torch.float32, 128, torch.float32) is None
    assert long_prefill_config("cuda", bf16, 64, bf16) is None
    assert LONG_PREFILL_TOKENS == 8192


@pytest.mark.parametrize("fp8", [False, True], ids=["16-bit-cache", "fp8-cache-token-major"])
def test_long_prefill_tiles(fp8: bool) -> None:
    """The long-prefill tiles against the reference: a long chunk after a 300-token context, beside a
    short chunk and a decode row. On a GPU the chunk is LONG_PREFILL_TOKENS, which picks the tiles
    itself; the interpreter runs them by name on a 40-token chunk (bf16: the GPU only, as above)."""
    q_len = 40 if INTERPRET else LONG_PREFILL_TOKENS
    dtype = torch.float16 if INTERPRET else torch.bfloat16
    batch = make_batch(
        [q_len, 20, 1], [q_len + 300, 70, 90], num_heads=4, num_kv_heads=1, head_dim=128, dtype=dtype,
        block_size=16, num_blocks=q_len // 16 + 64, seed=9,
    )  # fmt: skip
    if fp8:
        for name in ("k_cache", "v_cache"):
            batch[name] = (batch[name].float() * 2).to(torch.float8_e4m3fn)
        batch.update(k_scale=0.5, v_scale=0.5)
        batch["v_cache"] = kv_cache.token_major_copy(batch["v_cache"])
    if INTERPRET:
        tiles = long_prefill_config("cuda", dtype, 128, batch["k_cache"].dtype)
        assert tiles is not None
        check(batch, prefill_config=tiles)
    else:
        check(batch)


def test_bad_inputs_are_refused() -> None:
    batch = make_batch([1, 4], [20, 10], num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"dtype|share"):
        paged_attention(**{**batch, "k_cache": batch["k_cache"].half()})
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_attention(**{**batch, "q": batch["q"][:, :3]})
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(**{**batch, "q": batch["q"][..., :24].contiguous()})
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention(**{**batch, "query_start_loc": batch["query_start_loc"][:2]})
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention(**{**batch, "block_tables": batch["block_tables"].float()})
