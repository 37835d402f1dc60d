#!/usr/bin/env bash
# `pagoda serve` on one GPU with a random-weight Llama-3.1-8B-shaped model, loaded by `pagoda bench
# serve` at several concurrencies. The GPU machine lacks FastAPI/uvicorn/pydantic (and has older
# grpc/protobuf): carry them as wheels in .whl (see /work/.library/device/README.md).
# Usage: bash bench/gpu_serve.sh TOKENIZER_DIR OUT_DIR
set -uo pipefail
tok=${1:?tokenizer folder}; out=${2:?output folder}
# shellcheck source=bench/device_env.sh
source "$(dirname "$0")/device_env.sh"
python3 -m pagoda.bench.gpu_check --tokenizer "$tok" --build-8b /tmp/llama-8b-random > /dev/null 2>&1 || exit 1
python3 -m pagoda.cli serve --model /tmp/llama-8b-random --served-model-name llama-8b-random --port 8000 \
    --grpc-port 8001 --max-num-seqs 128 > "$out/serve.log" 2>&1 &
for _ in $(seq 300); do curl -sf localhost:8000/v1/health/ready > /dev/null && break; sleep 1; done
curl -sf localhost:8000/v1/health/ready || { tail -30 "$out/serve.log"; exit 1; }
for c in 1 16 64 128; do
    n=$((c < 16 ? 16 : 2 * c))
    python3 -m pagoda.bench serve --model llama-8b-random --vocab-size 128256 --num-prompts $n \
        --input-len 128 --output-len 128 --max-concurrency $c --output "$out/serve_bench.md" | head -3
done
kill -TERM %1; wait
