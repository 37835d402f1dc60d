"""Long prompt chunks through `cudnn_attention` (on the CPU its PyTorch twin) give the model the same
answers as the paged path, in a batch that mixes them with decodes and short prefills."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagoda.kernels import cudnn_attention
from pagoda.service.engine.runner.pipeline import attention_metadata
from pagoda.service.model.attention import LongChunk
from pagoda.service.model.loader import load_model

PROMPT = [1, 504, 3458, 282, 4649, 314, 17535, 30, 378, 3821, 5284, 281, 260, 7265, 28, 9906, 1345, 28, 216]


def test_the_split_names_each_long_chunk_and_lays_out_the_runs_between() -> None:
    """Rows 1 and 3 are long: the runs are rows [0], [2] and [4], each with its own query offsets. A
    whole prompt is long from `whole_prompt_tokens`."""
    lens = np.array([1, 9, 3, 12, 1])
    starts = np.concatenate([[0], np.cumsum(lens)])
    seq_lens = np.array([40, 30, 3, 50, 7])
    batch = {
        "slot_mapping": np.arange(starts[-1]),
        "block_tables": np.arange(5 * 4).reshape(5, 4),
        "seq_lens": seq_lens,
        "query_start_loc": starts,
        "max_query_len": lens.max(),
    }
    meta = attention_metadata(batch, torch.device("cpu"), long_chunk_tokens=9)
    assert meta.long_chunks == (LongChunk(1, 1, 10, 30), LongChunk(3, 13, 25, 50))
    assert [(start, end) for start, end, _ in meta.paged_runs] == [(0, 1), (10, 13), (25, 26)]
    middle = meta.paged_runs[1][2]
    assert middle.query_start_loc.tolist() == [0, 3]
    assert middle.seq_lens.tolist() == [3]
    assert middle.block_tables.tolist() == [[8, 9, 10, 11]]
    assert (middle.max_query_len, middle.max_seq_len) == (3, 3)
    assert middle.slot_mapping.tolist() == [10, 11, 12]
    assert not middle.long_chunks and not middle.paged_runs
    # Rows 0 and 4 decode (one query token): their runs launch the decode kernels, row 2's does not.
    assert [run.decode_rows for _, _, run in meta.paged_runs] == [True, False, True] and meta.decode_rows
    prompts = attention_metadata(
        {**batch, "query_start_loc": np.array([0, 2, 11, 14, 26, 28])}, torch.device("cpu")
    )
    assert not prompts.decode_rows  # no row of one token: an eager prompt step
    plain = attention_metadata(batch, torch.device("cpu"), long_chunk_tokens=13)
    assert not plain.long_chunks and not plain.paged_runs
    # Whole prompts (no cached prefix: row 2, 3 tokens of 3) from their own, lower threshold; row 1's
    # 9 tokens behind a prefix stay below the long-chunk one.
    whole = attention_metadata(batch, torch.device("cpu"), long_chunk_tokens=13, whole_prompt_tokens=3)
    assert whole.long_chunks == (LongChunk(2, 10, 13, 3),) and whole.long_chunks[0].whole_prompt
    assert [(start, end) for start, end, _ in whole.paged_runs] == [(0, 10), (13, 26)]
    assert not meta.long_chunks[0].whole_prompt
    for above in (4, 13):
        assert not attention_metadata(batch, torch.device("cpu"), 13, above).long_chunks
    # At a real prompt's size (ints past CPython's small-int cache: compared by value).
    assert LongChunk(0, 5000, 9096, 4096).whole_prompt and not LongChunk(0, 5000, 9096, 4097).whole_prompt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_without_rotary_writes_the_cache_and_attends_causally(dtype: torch.dtype) -> None:
    """`PagedAttention` handed q, K and V as they are (no rotary launch): K and V go to their slots, the
    output is causal softmax attention at 1/sqrt(head_dim); an fp8 product still to be scaled is refused
    there (only the rotary launch scales). The prompt is a whole-prompt long chunk: in bf16, which
    `cudnn_attention` takes, it attends from the cache (no own rows without the rotary launch); in fp32
    the paged kernel attends it."""
    from pagoda.service.model.attention import PagedAttention, allocate_kv_cache

    torch.manual_seed(3)
    layer = PagedAttention(4, 2, 16)
    allocate_kv_cache([layer], 4, 4, dtype, torch.device("cpu"), v_token_major=False)
    q, k, v = (torch.randn(6, n, 16).to(dtype) for n in (4, 2, 2))
    batch = {
        "slot_mapping": np.array([8, 9, 10, 11, 4, 5]),  # blocks 2 and 1
        "block_tables": np.array([[2, 1]]),
        "seq_lens": np.array([6]),
        "query_start_loc": np.array([0, 6]),
        "max_query_len": np.array([6]),
    }
    meta = attention_metadata(batch, torch.device("cpu"), 9, 2)  # 6 tokens of 6: a whole prompt
    assert meta.long_chunks[0].whole_prompt
    out = layer(q.clone(), k.clone(), v.clone(), meta)
    assert torch.equal(layer.k_cache[2], k[:4]) and torch.equal(layer.v_cache[1, :2], v[4:])
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(out, expected)
    scales = (torch.ones(6, 1), torch.ones(1, 64))
    with pytest.raises(ValueError, match="scaled by the rotary launch only"):
        layer(q, k, v, meta, scaled=(scales, dtype))


@pytest.mark.parametrize("bucket", [4, 512])
def test_long_chunks_give_the_paged_paths_logits(
    llama_ckpt: Path, paged_runner, bucket: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 6+ tokens take cudnn_attention: a whole prompt, a chunk after a 7-token prefix (with
    bucket 4, split at 4: the unmasked call and the merge), beside a decode row and a short prefill.
    bf16, as cuDNN runs; the paged path is the reference kernel in the same dtype."""
    monkeypatch.setattr(cudnn_attention, "SHAPE_BUCKET", bucket)
    model, _ = load_model(llama_ckpt, dtype=torch.bfloat16)
    long, plain = paged_runner(model, long_chunk_tokens=6), paged_runner(model)
    steps = [
        {0: PROMPT[:7], 1: PROMPT[:3], 2: PROMPT},
        {0: PROMPT[7:], 1: [42], 2: [7], 3: PROMPT[:4]},
        {0: [5], 1: [43], 3: PROMPT[4:12]},
    ]
    taken = 0
    for chunks in steps:
        got, want = long.step(chunks), plain.step(chunks)
        taken += len(long.last_meta.long_chunks)
        for g, w in zip(got, want, strict=True):
            # Logits up to ~3.7, in bf16 (a unit in the last place 0.016): the two paths differ by up to
            # 0.047 here; weighting the merge's two halves 5% wrong moves them by 0.22.
            torch.testing.assert_close(g.float(), w.float(), atol=0.1, rtol=0)
    assert taken == 4  # the chunks of 7, 19, 12 and 8 tokens


def test_whole_prompts_under_fp8_attend_the_rotary_launch_s_scaled_keys_and_values(
    llama_ckpt: Path, paged_runner, monkeypatch: pytest.MonkeyPatch, cudnn_calls: list[int]
) -> None:
    """W8A8 hands the rotary launch qkv_proj's unscaled product: for a whole prompt it scales and
    rotates K and V into the step's own rows too (`kv_out`), which `prompt_attention` reads instead of
    the cache. The product is `torch._scaled_mm`'s on a GPU: a stand-in (the float32 product of the
    codes, as tests/test_fp8.py's) holds the wiring here. A bf16 cache holds those K and V bit for bit,
    so the logits are exactly those of the same chunks gathered back from the cache (`chunk_attention`,
    the own rows switched off); against the paged kernel fp8 activations amplify the two kernels' bf16
    rounding (up to 0.26 here), which the bf16 test above bounds. With a bucket of 4, the 13-token
    prompt that ends the first step reads 3 rows past it (the zeroed rows the layer leaves there); the
    second step holds a whole prompt beside a chunk behind its cached prefix (which reads the cache)."""
    from pagoda.kernels import reference
    from pagoda.service.model.attention import PagedAttention
    from pagoda.service.model.fp8 import Fp8Linear, ScaledProduct, quantize_model_fp8

    def unscaled_product_gpu_stand_in(self: Fp8Linear, x: object) -> ScaledProduct:
        xq, x_scale = x if isinstance(x, tuple) else reference.quantize_fp8_rows(x)  # type: ignore[arg-type]
        return ScaledProduct(xq.float() @ self.weight.float().t(), x_scale, self.weight_scale, self.out_dtype)

    model, _ = load_model(llama_ckpt, dtype=torch.bfloat16)
    quantize_model_fp8(model, torch.device("cpu"))
    assert all(layer.self_attn.defer_qkv_scales for layer in model.model.layers)
    monkeypatch.setattr(Fp8Linear, "product_with_scales", unscaled_product_gpu_stand_in)
    monkeypatch.setattr(cudnn_attention, "SHAPE_BUCKET", 4)
    steps = ({0: PROMPT[:7], 1: PROMPT[:3], 2: PROMPT[:13]}, {0: PROMPT[7:], 1: [9], 2: [11], 3: PROMPT})
    own = paged_runner(model, long_chunk_tokens=6)
    got = [own.step(chunks) for chunks in steps]
    layers = len(model.model.layers)
    assert cudnn_calls == [4 * layers, 3 * layers]  # prompts of 7, 13 and 19 tokens; the 12-token chunk
    monkeypatch.setattr(PagedAttention, "_own_rows", lambda *args: None)
    gathered = paged_runner(model, long_chunk_tokens=6)
    for chunks, g in zip(steps, got, strict=True):
        for a, b in zip(g, gathered.step(chunks), strict=True):
            assert torch.equal(a, b)
    assert cudnn_calls == [8 * layers, 3 * layers]  # all four from the cache


def test_the_engine_sends_long_chunks_through_cudnn_by_default(
    llama_ckpt: Path, monkeypatch: pytest.MonkeyPatch, cudnn_calls: list[int]
) -> None:
    """The engine's default (`long_prefill_attention="cudnn"`) hands an eager step's long chunks to
    `cudnn_attention` and gives the paged engine's greedy tokens; "paged" never calls it. The threshold is
    lowered to 6 tokens, so a 19-token prompt in chunks of 12 and 7 takes the path twice: the first chunk,
    a whole prompt, on the step's own K/V (`prompt_attention`), the second behind its cached prefix
    (`chunk_attention`), which hands cuDNN token-major views (K and V gathered token-major), the layout
    timed faster on a GPU."""
    from pagoda.service.engine.runner import model_runner
    from pagoda.service.llm import LLM
    from pagoda.service.sampling_params import SamplingParams

    monkeypatch.setattr(model_runner, "LONG_CHUNK_TOKENS", 6)
    layouts: list[bool] = []
    real_gather = cudnn_attention.gather_context

    def gather(*args: Any, **kwargs: Any) -> torch.Tensor:
        call = inspect.signature(real_gather).bind(*args, **kwargs)
        call.apply_defaults()
        layouts.append(call.arguments["token_major"])
        return real_gather(*args, **kwargs)

    monkeypatch.setattr(cudnn_attention, "gather_context", gather)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    common: dict = {"dtype": "bfloat16", "device": "cpu", "max_num_batched_tokens": 12, "enforce_eager": True}
    outputs = {}
    for attention in ("paged", "cudnn"):
        before = list(cudnn_calls)
        with LLM(str(llama_ckpt), long_prefill_attention=attention, **common) as llm:
            outputs[attention] = llm.generate([PROMPT], params)[0].outputs[0].token_ids
        whole, chunks = cudnn_calls[1] - before[1], cudnn_calls[0] - cudnn_calls[1] - before[0] + before[1]
        assert (whole > 0, chunks > 0) == ((attention == "cudnn",) * 2), (attention, whole, chunks)
    assert outputs["cudnn"] == outputs["paged"]
    assert layouts and all(layouts), layouts


def test_warm_up_attends_the_budgets_chunk_behind_whole_budget_prefixes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`PagedAttention.build_long_chunk_plans`: an 8-token chunk behind 8 and 16 tokens in a 30-token
    model (cuDNN's plans for a long prompt's later chunks), reading the cache, writing none of it; none
    in fp32, which cuDNN does not run."""
    from pagoda.service.model.attention import PagedAttention, allocate_kv_cache

    layer = PagedAttention(4, 2, 16)
    cache = allocate_kv_cache([layer], 8, 4, torch.bfloat16, torch.device("cpu"), v_token_major=True)
    cache.normal_()
    before = cache.clone()
    seen: list[tuple[int, int, int]] = []
    real = cudnn_attention.chunk_attention

    def recorded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, context_len: int,
                 *rest: object) -> None:  # fmt: skip
        assert k is layer.k_cache and v is layer.v_cache
        seen.append((q.shape[0], context_len, blocks.shape[0]))
        real(q, k, v, blocks, context_len, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(cudnn_attention, "chunk_attention", recorded)
    assert layer.build_long_chunk_plans(8, 30, torch.bfloat16) == [16, 24]
    assert seen == [(8, 16, 8), (8, 24, 8)]  # 30 tokens in blocks of 4: 8 block ids
    assert torch.equal(cache, before)
    assert layer.build_long_chunk_plans(8, 30, torch.float32) == [] and len(seen) == 2
    assert layer.build_long_chunk_plans(8, 32, torch.bfloat16) == [16, 24, 32]  # a context of the whole model


def test_warm_up_attends_whole_prompts_of_every_bucketed_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """`PagedAttention.build_whole_prompt_plans(5, 30)` with a bucket of 8: one `prompt_attention` call per
    length a 5- to 30-token prompt is padded to (8 to 32), on rows laid out as a step's own (token-major,
    contiguous); none in fp32."""
    from pagoda.service.model.attention import PagedAttention, allocate_kv_cache

    monkeypatch.setattr(cudnn_attention, "SHAPE_BUCKET", 8)
    layer = PagedAttention(4, 2, 16)
    allocate_kv_cache([layer], 8, 4, torch.bfloat16, torch.device("cpu"), v_token_major=True)
    seen: list[tuple[int, ...]] = []
    real = cudnn_attention.prompt_attention

    def recorded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_len: int, *rest: object) -> None:
        assert all(t.is_contiguous() for t in (q, k, v)) and (q.shape[1], k.shape[1], v.shape[1]) == (4, 2, 2)
        seen.append((q.shape[0], k.shape[0], q_len))
        real(q, k, v, q_len, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(cudnn_attention, "prompt_attention", recorded)
    assert layer.build_whole_prompt_plans(5, 30, torch.bfloat16) == [8, 16, 24, 32]
    assert seen == [(n, n, n) for n in (8, 16, 24, 32)]
    assert layer.build_whole_prompt_plans(5, 30, torch.float32) == [] and len(seen) == 4
    assert layer.build_whole_prompt_plans(31, 30, torch.bfloat16) == [] and len(seen) == 4
    assert layer.build_whole_prompt_plans(17, 17, torch.bfloat16) == [24] and seen[-1] == (24, 24, 24)
    assert layer.build_whole_prompt_plans(16, 16, torch.bfloat16) == [16]  # a whole bucket: no more


@pytest.mark.parametrize("token_major", [False, True], ids=["head-major", "token-major"])
@pytest.mark.parametrize(
    ("prefix", "q_len", "bucket", "v_scale"),
    [
        (0, 13, 4, 2.0), (0, 13, 4, 0.5), (7, 13, 4, 1.0), (7, 13, 4, 0.5), (9, 6, 8, 1.0), (16, 5, 4, 3.0),
        (0, 12, 4, 1.0), (8, 12, 4, 0.5),  # no row to pad: the token-major variant passes q itself
    ],
)  # fmt: skip
def test_chunk_attention_is_the_reference_at_bucketed_shapes(
    prefix: int, q_len: int, bucket: int, v_scale: float, token_major: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`chunk_attention` on the CPU (PyTorch's flash op) against `reference.paged_attention`: whole
    prompts and chunks behind prefixes below, at and past a bucket, with V scaled; every call's query
    and key lengths are multiples of the bucket (cuDNN builds a plan per shape), K and V alike. Both
    layouts of what the calls are handed (`token_major`: strided views, no head-major copies)."""
    from pagoda.kernels import reference

    torch.manual_seed(prefix * 100 + q_len)
    context_len = prefix + q_len
    kc, vc = (torch.randn(16, 4, 2, 16).to(torch.bfloat16) for _ in range(2))
    blocks = torch.randperm(16, dtype=torch.int32)
    q = torch.randn(q_len, 4, 16).to(torch.bfloat16)
    shapes: list[tuple[int, int, bool]] = []
    real = cudnn_attention._attend

    def recorded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> object:
        shapes.append((q.shape[2], k.shape[2], causal))
        return real(q, k, v, causal, scale)

    monkeypatch.setattr(cudnn_attention, "_attend", recorded)
    out = torch.empty_like(q)
    # The defaults (unscaled K and V) where V is unscaled; an fp8 cache's K scale beside a V scale.
    k_scale = 1.0 if v_scale == 1.0 else 1.5
    scales = {} if v_scale == 1.0 else {"k_scale": k_scale, "v_scale": v_scale}
    cudnn_attention.chunk_attention(
        q, kc, vc, blocks, context_len, 0.25, out, bucket=bucket, token_major=token_major, **scales
    )
    want = reference.paged_attention(
        q, kc, vc, blocks[None], torch.tensor([context_len]), torch.tensor([0, q_len]), 0.25, q_len,
        context_len, k_scale, v_scale,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), want.float(), atol=0.03 * max(v_scale, 1.0), rtol=0.02)
    split = prefix // bucket * bucket
    assert all(rows % bucket == 0 and keys % bucket == 0 for rows, keys, _ in shapes), shapes
    assert [causal for *_, causal in shapes] == ([True] if split == 0 else [True, False])
    rows = -(-(context_len - split) // bucket) * bucket  # the fewest padded rows a bucket allows
    assert shapes[0][:2] == (rows, rows) and (split == 0 or shapes[1][:2] == (rows, split)), shapes


def test_chunk_attention_refuses_a_context_shorter_than_its_queries_or_an_output_of_another_shape() -> None:
    kc = vc = torch.zeros(4, 4, 2, 16, dtype=torch.bfloat16)
    blocks = torch.arange(4, dtype=torch.int32)
    q = torch.zeros(6, 4, 16, dtype=torch.bfloat16)
    for context_len, out in (
        (5, torch.empty_like(q)),
        (8, torch.empty(7, 4, 16)),
        (8, torch.empty(5, 4, 16)),
    ):
        with pytest.raises(ValueError, match="chunk_attention: 6 queries"):
            cudnn_attention.chunk_attention(q, kc, vc, blocks, context_len, 0.25, out)


def test_the_gather_reads_the_table_s_blocks_and_zeros_past_the_context() -> None:
    """A 7-token context in blocks of 4 (the second block half used), slot-major and token-major, as is
    and padded to 12 tokens: the keys in table order, widened to bf16, zeros past the context."""
    from pagoda.kernels.kv_cache import token_major_copy

    cache = torch.randn(6, 4, 2, 8).to(torch.float8_e4m3fn)
    blocks = torch.tensor([4, 1, 5], dtype=torch.int32)
    want = cache[[4, 1]].reshape(8, 2, 8)[:7].permute(1, 0, 2).to(torch.bfloat16)  # [heads, tokens, dim]
    for layout in (cache, token_major_copy(cache)):
        got = cudnn_attention.gather_context(layout, blocks, 7, torch.bfloat16)
        assert got.shape == (2, 7, 8) and torch.equal(got, want)
        tokens = cudnn_attention.gather_context(layout, blocks, 7, torch.bfloat16, token_major=True)
        assert tokens.shape == (7, 2, 8) and torch.equal(tokens, want.transpose(0, 1))
        padded = cudnn_attention.gather_context(layout, blocks, 7, torch.bfloat16, 12)
        assert padded.shape == (2, 12, 8) and torch.equal(padded[:, :7], want)
        assert not padded[:, 7:].any()
        rows = cudnn_attention.gather_context(layout, blocks, 7, torch.bfloat16, 12, token_major=True)
        assert (
            rows.shape == (12, 2, 8) and rows.is_contiguous() and torch.equal(rows[:7], want.transpose(0, 1))
        )
        assert not rows[7:].any()


def test_cudnn_runs_16_bit_queries_with_head_dims_multiple_of_8_up_to_128_on_the_cpu() -> None:
    def supported(dtype: torch.dtype, head_dim: int) -> bool:
        return cudnn_attention.is_supported(torch.zeros(2, 4, head_dim, dtype=dtype))

    assert supported(torch.bfloat16, 128) and supported(torch.float16, 64) and supported(torch.bfloat16, 8)
    assert not supported(torch.bfloat16, 136) and not supported(torch.bfloat16, 60)
    assert not supported(torch.float32, 128)
    assert not cudnn_attention.is_supported(torch.zeros(2, 4, 64, dtype=torch.bfloat16, device="meta"))


def test_the_gather_refuses_a_cache_whose_blocks_are_not_contiguous_runs() -> None:
    """A slice of each block's slots, or one block broadcast over the table, is no flat row a block."""
    cache = torch.zeros(6, 4, 2, 8, dtype=torch.bfloat16)
    blocks = torch.tensor([4, 1], dtype=torch.int32)
    for layout in (cache[:, :2], cache[:1].expand(6, 4, 2, 8)):
        with pytest.raises(ValueError, match="cache blocks must be contiguous runs"):
            cudnn_attention.gather_context(layout, blocks, 2, torch.bfloat16)


def test_the_attention_call_refuses_keys_and_values_of_other_lengths() -> None:
    """PyTorch's CPU op would read past a K view shorter than V (or than a causal call's queries)."""
    q = torch.zeros(1, 4, 8, 16, dtype=torch.bfloat16)
    kv = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16)
    for k, v, causal in (
        (kv[:, :, :4], kv, False),
        (kv, kv[:, :, :4], False),
        (kv[:, :, :4], kv[:, :, :4], True),
        (torch.cat([kv, kv], 2), torch.cat([kv, kv], 2), True),  # a causal call's queries are its keys
    ):
        with pytest.raises(ValueError, match="cudnn_attention: q"):
            cudnn_attention._attend(q, k, v, causal, 0.25)
    assert cudnn_attention._attend(q, kv[:, :, :4], kv[:, :, :4], False, 0.25)[0].shape == (4, 8, 16)


@pytest.mark.parametrize(("q_len", "longest"), [(6, 41), (13, 40)])
def test_the_transient_bound_holds_what_chunk_attention_allocates(
    q_len: int, longest: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`transient_bytes`, the room the KV cache's budget leaves a long chunk, against the storage
    `chunk_attention` allocates (the gathered K and V, the padded queries, both calls' outputs and
    log-sum-exps) for a chunk behind every prefix up to the longest context: the most any alignment
    allocates."""
    monkeypatch.setattr(cudnn_attention, "SHAPE_BUCKET", 4)
    heads, kv_heads, dim, dtype = 4, 2, 16, torch.bfloat16
    kc, vc = (torch.randn(16, 4, kv_heads, dim).to(dtype) for _ in range(2))
    blocks = torch.randperm(16, dtype=torch.int32)
    held: dict[int, int] = {}  # storage address -> bytes
    real_gather, real_attend = cudnn_attention.gather_context, cudnn_attention._attend

    def hold(*tensors: torch.Tensor) -> None:
        for t in tensors:
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    def gather(*args: object, **kwargs: object) -> torch.Tensor:
        out = real_gather(*args, **kwargs)  # type: ignore[arg-type]
        hold(out)
        return out

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> object:
        out, lse = real_attend(q, k, v, causal, scale)
        hold(q, out, lse)
        return out, lse

    monkeypatch.setattr(cudnn_attention, "gather_context", gather)
    monkeypatch.setattr(cudnn_attention, "_attend", attend)
    bound = cudnn_attention.transient_bytes(q_len, longest, heads, kv_heads, dim, dtype)
    worst = 0
    for prefix in range(longest - q_len + 1):
        held.clear()
        q = torch.randn(q_len, heads, dim).to(dtype)
        cudnn_attention.chunk_attention(q, kc, vc, blocks, prefix + q_len, 0.25, torch.empty_like(q))
        worst = max(worst, sum(held.values()))
    # The last prefix is 3 past a bucket: the most padded rows (6 queries take 3 buckets), the most keys.
    assert worst == bound


def test_warm_up_compiles_the_decode_variants_where_triton_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """`PagedAttention.compile_decode_variants` hands the layer's caches, one query token of its heads
    and the context length to the kernels' warm-up where the Triton kernels run (PAGODA_KERNELS=triton
    stands for a GPU here), and does nothing on the reference path."""
    from pagoda.kernels import attention as triton_attention
    from pagoda.service.model.attention import PagedAttention, allocate_kv_cache

    layer = PagedAttention(4, 2, 16)
    allocate_kv_cache([layer], 8, 4, torch.bfloat16, torch.device("cpu"), v_token_major=True)
    layer.k_scale, layer.v_scale = 0.5, 2.0
    calls: list[tuple[object, ...]] = []

    def recorded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: object) -> list[int]:
        calls.append((tuple(q.shape), q.dtype, k is layer.k_cache, v is layer.v_cache, *rest))
        return [1, 2]

    monkeypatch.setattr(triton_attention, "compile_decode_variants", recorded)
    monkeypatch.setenv("PAGODA_KERNELS", "reference")
    assert layer.compile_decode_variants(30, torch.bfloat16) == [] and not calls
    monkeypatch.setenv("PAGODA_KERNELS", "triton")
    assert layer.compile_decode_variants(30, torch.bfloat16) == [1, 2]
    assert calls == [((1, 4, 16), torch.bfloat16, True, True, 30, 0.5, 2.0)]


def test_warm_up_batches_fit_the_budget_and_total_tokens_of_each_kind_triton_compiles_apart() -> None:
    """The warm-up's prompt batches fit the step budget, and their token totals hold a multiple of 16 and
    a count that is not (Triton's variants of a kernel taking the step's token count)."""
    from pagoda.service.engine.runner.model_runner import warm_up_query_lens

    for budget in (16, 100, 2048, 8192):
        batches = warm_up_query_lens(budget)
        assert batches[0] == [budget] and all(sum(b) <= budget and min(b) >= 1 for b in batches)
        assert sorted({len(b) for b in batches}) == [1, 3, 4]
        totals = {(sum(b) == 1, sum(b) % 16 == 0) for b in batches}
        assert {(False, True), (False, False)} <= totals, (budget, batches)
        singles = [b[0] for b in batches if len(b) == 1][1:]
        assert singles == [n for n in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if n < budget]


def test_a_steps_layers_share_one_set_of_own_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole prompts' own-row buffers are made by a step's first layer and reused by the next (one set
    in the step's metadata, its K / V tail zeroed once); each layer's output is what it gives alone."""
    from pagoda.service.model.attention import AttentionMetadata, PagedAttention, allocate_kv_cache

    monkeypatch.setattr(cudnn_attention, "SHAPE_BUCKET", 4)
    torch.manual_seed(5)
    layers = [PagedAttention(4, 2, 16), PagedAttention(4, 2, 16)]
    allocate_kv_cache(layers, 8, 4, torch.bfloat16, torch.device("cpu"), v_token_major=True).normal_()
    lens = np.array([6, 1])  # a 6-token prompt, and a decode at position 4 (block 3's first slot)
    batch = {
        "slot_mapping": np.array([0, 1, 2, 3, 4, 5, 12]), "block_tables": np.array([[0, 1], [2, 3]]),
        "seq_lens": np.array([6, 5]), "query_start_loc": np.array([0, 6, 7]), "max_query_len": lens.max(),
    }  # fmt: skip
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 4])
    cos_sin = torch.randn(16, 16, dtype=torch.bfloat16)
    qkv = [tuple(torch.randn(7, h, 16, dtype=torch.bfloat16) for h in (4, 2, 2)) for _ in layers]

    def run(layer: PagedAttention, inputs: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = (t.clone() for t in inputs)
        return layer(q, k, v, meta, (positions, cos_sin))

    shared = attention_metadata(batch, torch.device("cpu"), 6, 6)
    assert shared.long_chunks and shared.long_chunks[0].whole_prompt
    first = run(layers[0], qkv[0], shared)
    (buffers,) = shared.own_rows.values()
    assert [tuple(t.shape) for t in buffers] == [(10, 4, 16), (10, 2, 16), (10, 2, 16)]  # 7 rows + 3
    second = run(layers[1], qkv[1], shared)
    assert len(shared.own_rows) == 1
    assert all(a is b for a, b in zip(next(iter(shared.own_rows.values())), buffers, strict=True))
    assert all(not t[7:].any() for t in buffers[1:])  # the K / V tail still zero
    for layer, inputs, got in zip(layers, qkv, (first, second), strict=True):
        alone = run(layer, inputs, attention_metadata(batch, torch.device("cpu"), 6, 6))
        assert torch.equal(got, alone)
