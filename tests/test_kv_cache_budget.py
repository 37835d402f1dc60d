"""The KV cache's share of a GPU, as vLLM's --gpu-memory-utilization means it: of the whole memory,
weights included (the same meaning as the operator's kvCacheFraction, whose profile sizes a GPU so).
The arithmetic alone: there is no GPU here."""

from __future__ import annotations

from pagoda.service.engine.runner.model_runner import kv_cache_budget

GIB = 1 << 30


def test_the_weights_and_anything_else_in_use_come_out_of_the_share() -> None:
    total = 140 * GIB
    after_weights = kv_cache_budget(total, free=124 * GIB, utilization=0.9, activations=2 * GIB)
    # 126 GiB is the engine's share; 16 GiB of it already holds the weights; 2 GiB of activations and
    # the 0.5 GiB reserve stay out of the cache.
    assert after_weights == int(total * 0.9) - 16 * GIB - 2 * GIB - (512 << 20)
    # Another process holding 10 GiB leaves that much less, not the same share of less.
    crowded = kv_cache_budget(total, free=114 * GIB, utilization=0.9, activations=2 * GIB)
    assert after_weights - crowded == 10 * GIB


def test_a_share_smaller_than_what_is_in_use_leaves_no_budget() -> None:
    assert kv_cache_budget(80 * GIB, free=60 * GIB, utilization=0.2, activations=0) < 0
    assert kv_cache_budget(80 * GIB, free=60 * GIB, utilization=0.3, activations=0) > 0


def test_memory_this_process_has_cached_but_freed_is_reusable() -> None:
    """A second engine in one process (the offline LLM, a test's graphs run then its eager run): the first
    one's freed KV cache is still reserved by the caching allocator, so the device reports it taken."""
    fresh = kv_cache_budget(80 * GIB, free=70 * GIB, utilization=0.9, activations=GIB)
    after_another = kv_cache_budget(80 * GIB, free=2 * GIB, utilization=0.9, activations=GIB, cached=68 * GIB)
    assert after_another == fresh > 0
    assert kv_cache_budget(80 * GIB, free=2 * GIB, utilization=0.9, activations=GIB) < 0


def test_a_step_leaves_room_for_a_long_chunk_s_gathered_context() -> None:
    """`step_activation_bytes`: the largest step's activations and float32 logits, plus, where prompt
    chunks of the budget's length attend through cuDNN, their gathered context at the longest context
    (`cudnn_attention.transient_bytes`); not where they attend paged (the flag, fp32, a budget under
    LONG_CHUNK_TOKENS). From WHOLE_PROMPT_TOKENS whole prompts' own K and V rows too, a bucket past the
    step. A draft model's step adds its own activations and logits."""
    import torch

    from pagoda.kernels.cudnn_attention import transient_bytes
    from pagoda.service.engine.config import EngineConfig
    from pagoda.service.engine.runner.model_runner import step_activation_bytes
    from pagoda.service.model.attention import LONG_CHUNK_TOKENS, WHOLE_PROMPT_TOKENS, PagedAttention
    from pagoda.service.model.config import ModelConfig

    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64}
    raw |= {"intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    raw |= {"num_key_value_heads": 2, "max_position_embeddings": 65536}
    mc = ModelConfig.from_hf_dict(raw)
    draft = ModelConfig.from_hf_dict(raw | {"hidden_size": 32, "intermediate_size": 48, "vocab_size": 100})
    attention = PagedAttention(4, 2, 16)
    bf16, cpu = torch.bfloat16, torch.device("cpu")

    def step_bytes(
        dtype: torch.dtype = bf16, draft_config: ModelConfig | None = None, **fields: object
    ) -> int:
        config = EngineConfig(max_num_batched_tokens=8192, max_num_seqs=4, **fields)  # type: ignore[arg-type]
        return step_activation_bytes(config, mc, attention, dtype, cpu, draft_config)

    def own(tokens: int) -> int:  # whole prompts' K and V, 2 kv heads of 16 in bf16, 512 rows past the step
        return 2 * (tokens + 512) * 2 * 16 * 2

    step = 8192 * (4 * 64 + 3 * 128) * 2 + 3 * 4 * 100 * 4
    assert step_bytes(long_prefill_attention="paged") == step
    assert step_bytes() == step + transient_bytes(8192, 65536, 4, 2, 16, bf16) + own(8192)
    assert step_bytes(max_model_len=16384) == step + transient_bytes(8192, 16384, 4, 2, 16, bf16) + own(8192)
    assert step_bytes(torch.float32) == 2 * step - 3 * 4 * 100 * 4  # fp32 queries: the paged kernel
    for tokens in (LONG_CHUNK_TOKENS - 1, WHOLE_PROMPT_TOKENS, WHOLE_PROMPT_TOKENS - 1):
        few = EngineConfig(max_num_batched_tokens=tokens, max_num_seqs=4)
        small_step = tokens * (4 * 64 + 3 * 128) * 2 + 3 * 4 * 100 * 4
        whole = own(tokens) if tokens >= WHOLE_PROMPT_TOKENS else 0
        assert step_activation_bytes(few, mc, attention, bf16, cpu) == small_step + whole, tokens
    at = EngineConfig(max_num_batched_tokens=LONG_CHUNK_TOKENS, max_num_seqs=4)
    at_step = LONG_CHUNK_TOKENS * (4 * 64 + 3 * 128) * 2 + 3 * 4 * 100 * 4
    long_chunk = transient_bytes(LONG_CHUNK_TOKENS, 65536, 4, 2, 16, bf16)
    assert step_activation_bytes(at, mc, attention, bf16, cpu) == at_step + long_chunk + own(
        LONG_CHUNK_TOKENS
    )
    with_draft = step_bytes(long_prefill_attention="paged", draft_config=draft)
    assert with_draft == step + 8192 * (4 * 32 + 3 * 48) * 2 + 3 * 4 * 100 * 4
