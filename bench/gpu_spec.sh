#!/usr/bin/env bash
# Speculative decoding (issue 34) on one CUDA GPU, in one call: `pagoda bench spec` (prompt lookup
# against none on one loaded engine, greedy) on the Llama-3.1-8B-shaped random checkpoint, as an echo
# (it repeats its last token: every draft is right, the gain at full acceptance) and as it is (random
# output: lookups that find nothing or drafts that miss, the cost when speculation does not pay), by
# batch size up to where the load rule stops drafting. The embedded SmolLM2 (the CPU figures'
# real model) is not on the GPU machine: its file is larger than what a call carries.
# SPEC_DRAFT=1 adds a draft model that is the target itself (as it is: every draft right, each at a
# draft model's full cost: the issue's "draft = target").
# SPEC_BUSY=N profiles N steady steps at each batch, plain and drafting at every step: wall, GPU-busy and
# idle ms per step, tokens per step, and the 8 kernels with the most GPU time (where a drafting step's
# time goes).
# SPEC_DRAFT=only runs the draft model alone (no prompt-lookup runs); SPEC_BUSY profiles it too.
# SPEC_ARGS: extra `pagoda bench spec` flags for every run (e.g. --no-adaptive: the measured rule off).
# Env: SPEC_PRECISIONS (bf16 fp8), SPEC_BATCHES (1,16,32,64,256), SPEC_DRAFT (unset), SPEC_BUSY (unset)., SPEC_ARGS.
# Usage: bash bench/gpu_spec.sh TOKENIZER_DIR OUT_DIR   (carry .whl and out/tok: bench/device_wheels.sh)
set -uo pipefail
tok=${1:?tokenizer folder}; out=${2:?output folder}
# shellcheck source=bench/device_env.sh
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ensure_8b "$tok"
step checkpoint
for q in ${SPEC_PRECISIONS:-bf16 fp8}; do
    quant=(); [ "$q" = fp8 ] && quant=(--quantization fp8)
    lookups=(--echo ""); [ "${SPEC_DRAFT:-}" = only ] && lookups=()
    for echo in "${lookups[@]}"; do
        # shellcheck disable=SC2086  # SPEC_ARGS: several flags, split on purpose
        python3 -m pagoda.bench spec --model /tmp/llama-8b-random --dtype bfloat16 "${quant[@]}" ${echo:+--echo} \
            --copy-batches 1 --random-batches "${SPEC_BATCHES:-1,16,32,64,256}" --output "$out/spec.md" \
            ${SPEC_BUSY:+--busy-steps "$SPEC_BUSY" --busy-top 8} ${SPEC_ARGS:-} 2>&1 | grep -v Loading | tail -40
        step "$q ${echo:-random}"
    done
    if [ -n "${SPEC_DRAFT:-}" ]; then
        # shellcheck disable=SC2086  # SPEC_ARGS: several flags, split on purpose
        python3 -m pagoda.bench spec --model /tmp/llama-8b-random --dtype bfloat16 "${quant[@]}" \
            --draft-model /tmp/llama-8b-random --copy-batches 1 --random-batches "${SPEC_BATCHES:-1,16,32,64,256}" \
            --output "$out/spec.md" ${SPEC_BUSY:+--busy-steps "$SPEC_BUSY" --busy-top 8} ${SPEC_ARGS:-} 2>&1 \
            | grep -v Loading | tail -40
        step "$q draft = target"
    fi
done
