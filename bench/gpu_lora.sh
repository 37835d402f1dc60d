#!/usr/bin/env bash
# Multi-LoRA (issue 35) on one CUDA GPU, in one call: `pagoda bench lora` on the Llama-3.1-8B-shaped
# random checkpoint, decode with 8 rank-16 adapters on every projection spread over the batch against
# the base model alone (the goal: 85% of the base's tok/s at batch 64 in bf16), in bf16 and with an fp8
# base; then the LoRA kernels' GPU check, their timings against gather + bmm (`pagoda bench kernels
# --only lora`) and the engine's LoRA check (graphs, eager and references; tests/gpu/check_engine.py).
# Env: LORA_PRECISIONS (bf16 fp8), LORA_BATCHES (1,64), LORA_BUSY (unset; N: also profile N steady decode
# steps at each batch, base and adapters: wall, GPU-busy and idle ms a step, the top kernels).
# Usage: bash bench/gpu_lora.sh TOKENIZER_DIR OUT_DIR   (carry .whl and out/tok: bench/device_wheels.sh)
set -uo pipefail
tok=${1:?tokenizer folder}; out=${2:?output folder}
# shellcheck source=bench/device_env.sh
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ensure_8b "$tok"
step checkpoint
for q in ${LORA_PRECISIONS:-bf16 fp8}; do
    quant=(); [ "$q" = fp8 ] && quant=(--quantization fp8)
    python3 -m pagoda.bench lora --model /tmp/llama-8b-random --dtype bfloat16 "${quant[@]}" \
        --num-adapters 8 --rank 16 --batches "${LORA_BATCHES:-1,64}" --output "$out/lora.md" \
        ${LORA_BUSY:+--busy-steps "$LORA_BUSY" --busy-top 8} 2>&1 | grep -v Loading | tail -50
    step "$q"
done
cd "$root" || exit 1
python3 -m pytest -q -p no:cacheprovider tests/kernels/check_lora.py 2>&1 | tail -5
step "kernel check"
timeout 120 python3 -m pagoda.bench kernels --quick --only lora --markdown "$out/lora_kernels.md" 2>&1 | grep -E "lora|failed"
step "kernel timings"
PAGODA_GPU_TOKENIZER=$(realpath "$tok") timeout 200 python3 -m pytest -q -p no:cacheprovider -rA \
    tests/gpu/check_engine.py -k lora 2>&1 | grep -E "graphs|passed|failed|Error" | tail -6
step "engine check"
