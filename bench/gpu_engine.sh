#!/usr/bin/env bash
# The engine on one CUDA GPU, in one go (the device machine has torch/triton/transformers but not
# this package): correctness against transformers, then `pagoda bench offline` on a random-weight
# Llama-3.1-8B-shaped checkpoint. Usage: bash bench/gpu_engine.sh TOKENIZER_DIR OUT_DIR
set -uo pipefail
tok=${1:?tokenizer folder}; out=${2:?output folder}
root=$(cd "$(dirname "$0")/.." && pwd)
# msgspec and pyzmq (the engine's messages) are not on the GPU machine: carried as wheels in .whl.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$root"/.whl/*.whl || exit 1
shim=$(mktemp -d)/p
mkdir -p "$shim/pagoda" && cp "$root"/pagoda/*.py "$shim/pagoda/"
for d in kernels service operator; do ln -s "$root/$d" "$shim/pagoda/$d"; done
export PYTHONPATH=/tmp/site:$shim PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pagoda.service.gpu_check --tokenizer "$tok" 2>&1 | tee "$out/engine_check.log" | grep -v Loading
python3 -m pagoda.service.gpu_check --tokenizer "$tok" --build-8b /tmp/llama-8b-random 2>&1 | tail -3
python3 -m pagoda.service.bench offline --model /tmp/llama-8b-random --dtype bfloat16 \
    --num-prompts 64 --input-len 128 --output-len 128 --output "$out/bench.md" 2>&1 | tee "$out/bench.log" | grep -v Loading
python3 -m pagoda.service.bench offline --model /tmp/llama-8b-random --dtype bfloat16 --quantization fp8 \
    --num-prompts 64 --input-len 128 --output-len 128 --peer none --output "$out/bench.md" 2>&1 | tee -a "$out/bench.log" | grep -v Loading
