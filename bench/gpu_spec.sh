#!/usr/bin/env bash
# Speculative decoding (issue 34) on one CUDA GPU, in one call: `pagoda bench spec` (prompt lookup
# against none on one loaded engine, greedy) on the embedded SmolLM2 (a real model: the copy workload
# copies) and on the Llama-3.1-8B-shaped random checkpoint (bf16 and fp8: what drafting costs when
# its drafts miss, from batch 1 to 256), then the speculation tests on the GPU.
# Usage: bash bench/gpu_spec.sh TOKENIZER_DIR OUT_DIR   (carry .whl and out/tok: bench/device_wheels.sh)
set -uo pipefail
tok=${1:?tokenizer folder}; out=${2:?output folder}
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
start=$SECONDS
step() { echo "== $1 after $((SECONDS - start)) s"; }
python3 -m pagoda.bench spec --dtype bfloat16 --copy-batches 1,8 --random-batches 1,16,64 \
    --output "$out/spec.md" 2>&1 | grep -v Loading | tail -8
step smollm2
[ -f /tmp/llama-8b-random/config.json ] || python3 -m pagoda.bench.gpu_check --tokenizer "$tok" --build-8b /tmp/llama-8b-random 2>&1 | tail -1
step checkpoint
for q in "" "--quantization fp8"; do
    python3 -m pagoda.bench spec --model /tmp/llama-8b-random --dtype bfloat16 $q --copy-batches 1 \
        --random-batches "${SPEC_RANDOM_BATCHES:-1,16,32,64,256}" --output "$out/spec.md" 2>&1 | grep -v Loading | tail -10
    step "8b ${q:-bf16}"
done
cd "$root" && timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_speculative.py 2>&1 | tail -3
step "tests"
