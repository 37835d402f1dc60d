#!/usr/bin/env bash
# The engine on one CUDA GPU, in one go (the device machine has torch/triton/transformers but not
# this package): correctness against transformers, then `pagoda bench offline` on a random-weight
# Llama-3.1-8B-shaped checkpoint. Usage: bash bench/gpu_engine.sh TOKENIZER_DIR OUT_DIR
set -uo pipefail
tok=${1:?tokenizer folder}; out=${2:?output folder}
# shellcheck source=bench/device_env.sh
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pagoda.bench.gpu_check --tokenizer "$tok" 2>&1 | tee "$out/engine_check.log" | grep -v Loading
python3 -m pagoda.bench.gpu_check --tokenizer "$tok" --build-8b /tmp/llama-8b-random 2>&1 | tail -3
python3 -m pagoda.bench offline --model /tmp/llama-8b-random --dtype bfloat16 \
    --num-prompts 64 --input-len 128 --output-len 128 --output "$out/bench.md" 2>&1 | tee "$out/bench.log" | grep -v Loading
python3 -m pagoda.bench offline --model /tmp/llama-8b-random --dtype bfloat16 --quantization fp8 \
    --num-prompts 64 --input-len 128 --output-len 128 --peer none --output "$out/bench.md" 2>&1 | tee -a "$out/bench.log" | grep -v Loading
python3 -m pagoda.bench offline --model /tmp/llama-8b-random --dtype bfloat16 \
    --num-prompts 256 --input-len 128 --output-len 128 --peer none --output "$out/bench.md" 2>&1 | tee -a "$out/bench.log" | grep -v Loading
