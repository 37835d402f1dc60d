#!/usr/bin/env bash
# Tensor parallelism on a machine with N >= 2 GPUs, in one go: the engine GPU check at TP=N (fp32
# greedy vs transformers, CUDA graphs vs eager, bf16/fp8 teacher-forced), then `pagoda bench offline`
# on the random Llama-3.1-8B-shaped checkpoint at TP=1 and TP=N (batch 1, and 256 x 128/128 with the
# all-reduce time per decode step from the profiled steps). NCCL's NVLink-multicast variables
# stay as the machine sets them. Usage: bash bench/gpu_tp.sh TOKENIZER_DIR OUT_DIR [N]
set -uo pipefail
tok=${1:?tokenizer folder}; out=${2:?output folder}; tp=${3:-2}
# shellcheck source=bench/device_env.sh
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pagoda.bench.gpu_check --tokenizer "$tok" --tensor-parallel-size "$tp" 2>&1 | tee "$out/tp_check.log" | grep -E "^\||Device|Error|error" | head -40
ensure_8b "$tok"
for n in 1 "$tp"; do
    # Batch 1 at 1000 / 200, then 256 x 128/128 three times; the profiled steady decode steps list the
    # all-reduce kernels' time per step (nccl...AllReduce) beside the GEMMs.
    python3 -m pagoda.bench offline --model /tmp/llama-8b-random --dtype bfloat16 --tensor-parallel-size "$n" \
        --num-prompts 1 --input-len 1000 --output-len 200 --peer none --busy-steps 50 --busy-top 12 \
        --output "$out/tp_bench.md" 2>&1 | tee -a "$out/tp_bench.log" | grep -E "^\||us/step|decode at|Error|error"
    python3 -m pagoda.bench offline --model /tmp/llama-8b-random --dtype bfloat16 --tensor-parallel-size "$n" \
        --num-prompts 256 --input-len 128 --output-len 128 --peer none --repeat 3 --busy-steps 20 --busy-top 12 \
        --output "$out/tp_bench.md" 2>&1 | tee -a "$out/tp_bench.log" | grep -E "^\||us/step|decode at|median|Error|error"
done
