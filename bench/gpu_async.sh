#!/usr/bin/env bash
# Async scheduling on one CUDA GPU, in one call: the 8B-shaped random checkpoint, then `pagoda bench
# offline` with every batch run both with async scheduling and with steps in turn on the same loaded
# engine (their tokens compared), the GPU-busy share of a steady decode step in each mode, and last,
# if time allows, the fp32 engine checks (async == in turn, greedy and seeded, beside the rest).
# Usage: bash bench/gpu_async.sh TOKENIZER_DIR OUT_DIR
set -uo pipefail
tok=${1:?tokenizer folder}; out=${2:?output folder}
# shellcheck source=bench/device_env.sh
source "$(dirname "$0")/device_env.sh"
python3 -c "import msgspec, zmq, pagoda.service.engine.core.engine_core, pagoda.service.llm" || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ensure_8b "$tok"
echo "checkpoint ready after $((SECONDS - start)) s"
python3 -m pagoda.bench offline --model /tmp/llama-8b-random --dtype bfloat16 \
    --num-prompts 256 --input-len 128 --output-len 128 --peer none --async-scheduling both --busy-steps 20 \
    --output "$out/bench.md" 2>&1 | tee "$out/bench.log" | grep -v Loading
echo "bench done after $((SECONDS - start)) s"
timeout "${CHECK_TIMEOUT:-150}" python3 -m pagoda.bench.gpu_check --tokenizer "$tok" --only llama-gqa4-d64-llama3rope \
    2>&1 | tee "$out/engine_check.log" | grep -v Loading | tail -12
echo "all done after $((SECONDS - start)) s"
