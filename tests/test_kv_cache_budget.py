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
