#!/usr/bin/env bash
# Structured output served on one GPU, and the longest legitimate engine steps (issue 30): `pagoda serve`
# on the random Llama-3.1-8B-shaped checkpoint in bf16, loaded by `pagoda bench serve` with half of the
# requests under a small strict JSON Schema, at concurrency 1, 16 and 64 (each kind reported apart, in
# the same run); a py-spy profile of the server's processes at 64; then long prefills. The core logs
# every new longest step past 1 s (the first requests pay Triton's compiles): the stall timeout's
# measurement. Carry .whl and out/tok (bench/device_wheels.sh).
# Usage: bash bench/gpu_structured.sh TOKENIZER_DIR OUT_DIR
set -uo pipefail
tok=${1:?tokenizer folder}; out=${2:?output folder}
# shellcheck source=bench/device_env.sh
source "$(dirname "$0")/device_env.sh"
python3 -m pagoda.bench.gpu_check --tokenizer "$tok" --build-8b /tmp/llama-8b-random > "$out/build.log" 2>&1 ||
    { tail -20 "$out/build.log"; exit 1; }
python3 -m pagoda.cli serve --model /tmp/llama-8b-random --served-model-name llama-8b-random --port 8000 \
    --grpc-port 8001 --max-num-seqs 128 > "$out/serve.log" 2>&1 &
server=$!
for _ in $(seq 300); do curl -sf localhost:8000/v1/health/ready > /dev/null && break; sleep 1; done
curl -sf localhost:8000/v1/health/ready > /dev/null || { tail -30 "$out/serve.log"; exit 1; }
bench=(python3 -m pagoda.bench serve --model llama-8b-random --vocab-size 128256)
for c in 1 16 64; do
    n=$((c == 1 ? 16 : 4 * c))
    if [ "$c" = 64 ]; then
        /tmp/site/bin/py-spy record --subprocesses --nonblocking --format raw -d 8 -p "$server" \
            -o "$out/profile_c64.txt" > "$out/py-spy.log" 2>&1 &
    fi
    "${bench[@]}" --num-prompts "$n" --input-len 128 --output-len 128 --max-concurrency "$c" \
        --structured-fraction 0.5 --client-processes auto --output "$out/structured.md" | tail -8
done
wait %2 2> /dev/null
# Long prefills: 8 prompts of 7,900 tokens at once, chunked by the token budget.
"${bench[@]}" --num-prompts 8 --input-len 7900 --output-len 16 --output "$out/long_prefill.md" | head -3
kill -TERM "$server"; wait "$server"; echo "serve exited with $?"
grep -E "longest step|stall" "$out/serve.log"
