#!/usr/bin/env bash
# The GPU test suites with pytest, in one go: the Triton kernels against their PyTorch references
# (tests/kernels/check_*.py) and the engine against transformers (tests/gpu/check_engine.py).
# Usage: bash bench/gpu_checks.sh TOKENIZER_DIR OUT_DIR   (carry .whl and out/tok: bench/device_wheels.sh)
set -uo pipefail
tok=${1:?tokenizer folder}; out=${2:?output folder}
# shellcheck source=bench/device_env.sh
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cd "$root" || exit 1
PAGODA_GPU_TOKENIZER=$(realpath "$tok") python3 -m pytest -q -p no:cacheprovider -rA --durations=10 \
    tests/kernels/check_*.py tests/gpu/check_engine.py 2>&1 | tee "$out/gpu_checks.log" | grep -v '^PASSED' | tail -60
exit "${PIPESTATUS[0]}"
