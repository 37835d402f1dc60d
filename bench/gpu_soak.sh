#!/usr/bin/env bash
# Soak: `pagoda serve` on one GPU with a random-weight Llama-3.1-8B-shaped model, loaded by `pagoda bench
# soak` at twice its saturating request rate for DURATION seconds (mixed lengths, clients that
# disconnect mid-stream, hostile requests). The report is appended to OUT_DIR/soak.md.
# A soak outlasts one device call (10 minutes): start this under `setsid` in one call and collect
# OUT_DIR in the next (a process in its own session runs on while the machine is held).
# Usage: bash bench/gpu_soak.sh TOKENIZER_DIR OUT_DIR [DURATION_S]
set -uo pipefail
tok=${1:?tokenizer folder}; out=${2:?output folder}; duration=${3:-600}
mkdir -p "$out"
# shellcheck source=bench/device_env.sh
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt"
python3 -m pagoda.bench.gpu_check --tokenizer "$tok" --build-8b /tmp/llama-8b-random > "$out/build.log" 2>&1 \
    || { echo "build failed"; tail -20 "$out/build.log"; exit 1; }
python3 -m pagoda.cli serve --model /tmp/llama-8b-random --served-model-name llama-8b-random --port 8000 \
    --grpc-port 8001 --max-num-seqs 256 > "$out/serve.log" 2>&1 &
server=$!
for _ in $(seq 300); do curl -sf localhost:8000/v1/health/ready > /dev/null && break; sleep 1; done
curl -sf localhost:8000/v1/health/ready || { tail -30 "$out/serve.log"; exit 1; }
echo "serving; soak starts $(date +%T)"
python3 -m pagoda.bench.soak --model llama-8b-random --vocab-size 128256 --duration "$duration" \
    --saturation-seconds 60 --sample-every 30 --server-pid "$server" --output "$out/soak.md"
echo "soak exit $? at $(date +%T)"
kill -TERM "$server"; wait "$server"; echo "server exit $?"
grep -c -E "Traceback|ERROR" "$out/serve.log" | sed 's/^/error lines in serve.log: /'
touch "$out/done"
