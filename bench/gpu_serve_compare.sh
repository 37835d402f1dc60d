#!/usr/bin/env bash
# Served throughput of several source trees in one run (e.g. a commit and the one before it, each
# unpacked with `git archive`): `pagoda serve` of the random Llama-3.1-8B-shaped checkpoint (built
# first, as gpu_serve.sh does) under `pagoda bench serve` at each concurrency, 128 in / 128 out.
# Usage: bash bench/gpu_serve_compare.sh TOKENIZER_DIR OUT_DIR "64 128" TREE...
set -uo pipefail
tok=${1:?tokenizer folder}; out=${2:?output folder}; concurrencies=${3:?concurrencies}; shift 3
for tree in "$@"; do
    (
        source "$tree/bench/device_env.sh"
        [ -d /tmp/llama-8b-random ] || python3 -m pagoda.bench.gpu_check --tokenizer "$tok" \
            --build-8b /tmp/llama-8b-random > /dev/null 2>&1 || exit 1
        python3 -m pagoda.cli serve --model /tmp/llama-8b-random --served-model-name llama-8b-random \
            --port 8000 --grpc-port 8001 --max-num-seqs 256 > "$out/serve-$(basename "$tree").log" 2>&1 &
        for _ in $(seq 300); do curl -sf localhost:8000/v1/health/ready > /dev/null && break; sleep 1; done
        echo "## tree $(basename "$tree")" | tee -a "$out/serve_compare.md"
        for c in $concurrencies; do
            python3 -m pagoda.bench serve --model llama-8b-random --vocab-size 128256 \
                --num-prompts $((4 * c)) --input-len 128 --output-len 128 --max-concurrency "$c" \
                --output "$out/serve_compare.md" | head -3
        done
        kill -TERM %1; wait
    )
done
