"""Engine start-up time and the TTFT of its first long prompts, one at a time, with or without the warm-up's
cuDNN plans (`PagedAttention.build_long_chunk_plans`): a GPU-machine script for issue 37.

    python3 bench/first_long_prompts.py --model DIR [--no-plan-warm-up] [--time-calls] [--prompts N]

Each prompt is new random tokens (no prefix-cache hits), alone in its steps, so its chunks are the budget's
behind whole-budget prefixes: the shapes the warm-up builds. Without the warm-up, the first prompt's later
chunks each build a cuDNN plan on first use; the second prompt finds them cached.
"""

from __future__ import annotations

import argparse
import time

from pagoda.bench.offline import random_prompts
from pagoda.service.llm import LLM
from pagoda.service.model.attention import PagedAttention
from pagoda.service.sampling_params import SamplingParams


def _time_chunk_calls(calls: list[tuple[int, float]]) -> None:
    """Wrap `cudnn_attention.chunk_attention` as the model's attention calls it: each call synchronized and
    timed, (context length, ms) appended to `calls` (a first call of a shape includes its plan build)."""
    import torch

    from pagoda.service.model import attention

    chunk_attention = attention.cudnn_attention.chunk_attention

    def timed(q, k_cache, v_cache, block_table, context_len, *rest, **kw):  # type: ignore[no-untyped-def]
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = chunk_attention(q, k_cache, v_cache, block_table, context_len, *rest, **kw)
        torch.cuda.synchronize()
        calls.append((int(context_len), 1000 * (time.perf_counter() - t)))
        return out

    attention.cudnn_attention.chunk_attention = timed  # type: ignore[assignment]


def _summary(calls: list[tuple[int, float]]) -> str:
    """Per context length: the first call's ms (a new shape's includes its plan build), the others' median."""
    by_context: dict[int, list[float]] = {}
    for context, ms in calls:
        by_context.setdefault(context, []).append(ms)
    return ", ".join(
        f"{c}: first {t[0]:.1f} ms, then {sorted(t[1:])[len(t[1:]) // 2] if t[1:] else 0:.1f} x{len(t) - 1}"
        for c, t in by_context.items()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--input-len", type=int, default=32768)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--no-plan-warm-up", action="store_true", help="skip build_long_chunk_plans")
    parser.add_argument("--time-calls", action="store_true", help="time each cuDNN chunk call (synchronized)")
    args = parser.parse_args()
    calls: list[tuple[int, float]] = []
    if args.time_calls:
        _time_chunk_calls(calls)
    if args.no_plan_warm_up:  # this script's A/B switch, not a product setting
        PagedAttention.build_long_chunk_plans = lambda self, *a, **k: []  # type: ignore[method-assign]
    start = time.perf_counter()
    llm = LLM(
        args.model,
        dtype="bfloat16",
        quantization="fp8",
        kv_cache_dtype="fp8",
        max_num_seqs=4,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    label = "without" if args.no_plan_warm_up else "with"
    if calls:
        print("start-up's cuDNN chunk calls: " + _summary(calls))
        calls.clear()
    seconds, kv_tokens = time.perf_counter() - start, llm.engine.runner.kv.num_tokens
    print(f"{label} the plan warm-up: engine start-up {seconds:.1f} s, KV cache {kv_tokens} tokens")
    vocab = llm.engine.runner.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i in range(args.prompts):
        out = llm.generate(random_prompts(1, args.input_len, vocab, seed=1000 + i), params)[0]
        m = out.metrics
        assert m.first_token_time is not None
        ttft = 1000 * (m.first_token_time - m.arrival_time)
        print(f"{label} the plan warm-up: prompt {i + 1}, {args.input_len} tokens: TTFT {ttft:.0f} ms")
        if calls:
            print("  its cuDNN chunk calls: " + _summary(calls))
            calls.clear()
    llm.shutdown()


if __name__ == "__main__":
    main()
