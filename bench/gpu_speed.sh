#!/usr/bin/env bash
# Issue 11's speed figures on one CUDA GPU, in one call: the kernel microbenchmarks (fp8 projection
# paths, decode attention), batch-1 decode at 1000/200 and offline 256 x 128/128 (with the GPU-busy
# profile of a steady decode step and of the prefill), the offline grid, then `pagoda serve` loaded by
# `pagoda bench serve` at concurrency 1..256 from several client processes.
# Sections: check (the engine's GPU checks: fp32 greedy == transformers, graphs == eager, async == in
# turn, bf16/fp8 teacher-forced, the fp8 layer paths; the sampler against transformers' processors), kernels (fp8 GEMM paths and attention),
# attention (attention alone), sweeps (bench_fp8 --activation and --gemm-kernels with and without cuBLASLt's
# workspace, bench --sweep splits --sweep fp8), kchecks (tests/kernels on the GPU; KCHECKS_K: a -k expression), bs1, offline, grid, serve.
# Precision names: bf16, fp8 (W8A8 projections), either with "-kv8" (an fp8 KV cache).
# Env: BS1_PRECISIONS (bf16 fp8), OFFLINE_VARIANTS (";"-separated extra arguments), GRID_PRECISIONS
# (fp8-kv8 bf16), GRID_SHAPES (";"-separated "in out prompts"), GRID_ARGS (extra `bench offline` flags for
# the grid, e.g. "--max-cudagraph-capture-size 1024"), SERVE_PRECISIONS (bf16), SERVE_CONCURRENCY (1 16 64 128 256), API_SERVERS (1),
# CLIENT_PROCESSES (auto), BUSY_TRACE (set: bs1 and offline write Chrome traces of their profiled steps,
# trace_*.json), SERVE_VARIANTS (";"-separated extra `pagoda serve` arguments, a server each). With a py-spy wheel in the carried wheels, c >= 256 also profiles the API
# process for 6 s (pyspy_api_*.raw).
# Every section also leaves its results in OUT_DIR (bench.md, the checks' logs, the sweeps' markdown): a
# device call cut at its limit returns those files, not what its stdout held.
# Usage: bash bench/gpu_speed.sh TOKENIZER_DIR OUT_DIR [SECTIONS] (default: "kernels bs1 offline serve")
set -uo pipefail
tok=${1:?tokenizer folder}; out=${2:?output folder}; sections=${3:-kernels bs1 offline serve}
# shellcheck source=bench/device_env.sh
source "$(dirname "$0")/device_env.sh"
python3 -c "import msgspec, zmq, fastapi, uvicorn, httpx, pagoda.service.server, pagoda.service.llm, pagoda.bench.kernels_fp8" || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
has() { [[ " $sections " == *" $1 "* ]]; }
precision_args() {  # bench offline's arguments for a precision name
    case $1 in
        bf16) ;; fp8) echo --quantization fp8 ;; bf16-kv8) echo --kv-cache-dtype fp8 ;;
        fp8-kv8) echo --quantization fp8 --kv-cache-dtype fp8 ;; *) echo "unknown precision $1" >&2; return 1 ;;
    esac
}
ensure_8b "$tok"
step checkpoint
model=(--model /tmp/llama-8b-random --dtype bfloat16 --peer none)
if has check; then
    timeout "${CHECK_TIMEOUT:-240}" python3 -m pagoda.bench.gpu_check --tokenizer "$tok" --only llama-gqa4-d64-llama3rope \
        2>&1 | tee "$out/engine_check.log" | grep -v Loading | tail -14
    # The batched sampler against transformers' logits processors, each test on the CPU and on the GPU.
    timeout 120 python3 -m pytest -q -p no:cacheprovider "$root"/tests/test_sampler_reference.py 2>&1 | tee "$out/sampler_check.log" | tail -2
    step check
fi
if has kchecks; then  # the Triton kernels against their references, on the GPU (tests/kernels)
    timeout 300 python3 -m pytest -q -p no:cacheprovider "$root"/tests/kernels/check_*.py ${KCHECKS_K:+-k "$KCHECKS_K"} 2>&1 | tee "$out/kchecks.log" | tail -8
    step "kernel checks"
fi
if has kernels; then
    timeout 200 python3 -m pagoda.bench.kernels_fp8 --sweep --markdown "$out/fp8_kernels.md" 2>&1 | tail -40
    step "fp8 kernels"
fi
if has kernels || has attention; then
    # shellcheck disable=SC2086  # SPLITS_ARGS: several flags, split on purpose
    timeout 120 python3 -m pagoda.bench.kernels ${SPLITS_ARGS:---quick --sweep splits} --markdown "$out/attention.md" 2>&1 | tail -40
    step "attention kernels"
fi
if has sweeps; then  # SiLU-quant layouts, decode splits, fp8-cache layouts, cuBLASLt's fp8 kernels by workspace
    timeout 150 python3 -m pagoda.bench.kernels_fp8 --activation --markdown "$out/activation.md" 2>&1 | tail -12
    for ws in default 0; do
        ( [ $ws = default ] || export CUBLASLT_WORKSPACE_SIZE=$ws
          timeout 90 python3 -m pagoda.bench.kernels_fp8 --gemm-kernels --markdown "$out/gemm_kernels_$ws.md" 2>&1 | tail -14 )
    done
    timeout 330 python3 -m pagoda.bench.kernels --sweep splits --sweep fp8 --sweep-only \
        --markdown "$out/attention_sweeps.md" 2>&1 | grep "^  "
    step "sweeps"
fi
if has bs1; then
    for q in ${BS1_PRECISIONS:-bf16 fp8}; do
        read -ra extra <<< "$(precision_args "$q")"
        python3 -m pagoda.bench offline "${model[@]}" "${extra[@]}" --num-prompts 1 --input-len 1000 --output-len 200 \
            --busy-steps 50 --busy-top 14 ${BUSY_TRACE:+--busy-trace "$out/trace_bs1_$q.json"} \
            --output "$out/bench.md" 2>&1 | grep -v Loading | tail -24
        step "bs1 $q"
    done
fi
if has offline; then
    traced=0
    IFS=';' read -ra variants <<< "${OFFLINE_VARIANTS:- ;--quantization fp8;--kv-cache-dtype fp8;--quantization fp8 --kv-cache-dtype fp8}"
    for q in "${variants[@]}"; do
        traced=$((traced + 1))
        # shellcheck disable=SC2086  # $q: the precision flags, split on purpose
        python3 -m pagoda.bench offline "${model[@]}" $q --num-prompts 256 --input-len 128 --output-len 128 \
            --busy-steps 20 --busy-top 8 --profile-prefill ${BUSY_TRACE:+--busy-trace "$out/trace_offline_$traced.json"} \
            --output "$out/bench.md" 2>&1 | grep -v Loading | tail -28
        step "offline ${q:-bf16}"
    done
fi
if has grid; then  # issue 11's grid: in / out lengths, enough requests for a steady state
    for q in ${GRID_PRECISIONS:-fp8-kv8 bf16}; do
        read -ra extra <<< "$(precision_args "$q")"
        IFS=';' read -ra shapes <<< "${GRID_SHAPES:-1000 1000 384;128 2048 384;2048 128 1024}"
        for shape in "${shapes[@]}"; do
            read -r in_len out_len n <<< "$shape"
            [[ $q == *-kv8 && $n == 384 ]] && n=640  # an fp8 cache holds more (768 x 2.2k tokens overflowed it: preemptions)
            # shellcheck disable=SC2086  # GRID_ARGS: extra flags, split on purpose
            timeout 200 python3 -m pagoda.bench offline "${model[@]}" "${extra[@]}" --num-prompts "$n" \
                --input-len "$in_len" --output-len "$out_len" --max-num-batched-tokens 8192 ${GRID_ARGS:-} \
                --output "$out/bench.md" 2>&1 | grep -v Loading | tail -4
            step "grid $q $shape"
        done
    done
fi
if has serve; then
    IFS=';' read -ra serve_variants <<< "${SERVE_VARIANTS:- }"
    for q in ${SERVE_PRECISIONS:-bf16}; do for sv in "${serve_variants[@]}"; do
        extra=(); [ "$q" = fp8 ] && extra=(--precision fp8)
        read -ra sv_args <<< "$sv"
        echo "== serve $q ${sv}"; echo "## serve $q ${sv}" >> "$out/serve_metrics_$q.txt"
        python3 -m pagoda.cli serve --model /tmp/llama-8b-random --served-model-name m --port 8000 --grpc-port 8001 \
            --max-num-seqs 256 --api-server-count "${API_SERVERS:-1}" "${extra[@]}" "${sv_args[@]}" > "$out/serve_$q.log" 2>&1 &
        pid=$!
        for _ in $(seq 300); do
            curl -sf localhost:8000/v1/health/ready > /dev/null && break
            kill -0 $pid 2> /dev/null || { tail -20 "$out/serve_$q.log"; break; }
            sleep 1
        done
        step "serve $q ready"
        for c in ${SERVE_CONCURRENCY:-1 16 64 128 256}; do
            n=$((c < 16 ? 16 : 4 * c))
            if [ "$c" -ge 256 ] && [ -x /tmp/site/bin/py-spy ]; then  # where the API process spends a loaded second
                (sleep 4; /tmp/site/bin/py-spy record -p $pid -d 6 -r 100 -f raw -o "$out/pyspy_api_$q.raw" > /dev/null 2>&1) &
            fi
            timeout 120 python3 -m pagoda.bench serve --base-url http://localhost:8000 --model m --vocab-size 128256 \
                --num-prompts "$n" --input-len 128 --output-len 128 --max-concurrency "$c" --client-processes "${CLIENT_PROCESSES:-auto}" \
                --output "$out/serve_bench.md" 2>&1 | tail -14
            # The core's step-time histogram and GC pauses, cumulative: diff consecutive dumps.
            { echo "## c=$c"; curl -s localhost:8000/metrics | grep -E "^pagoda_(engine_(step_duration|gc_)|output_delay)"; } \
                >> "$out/serve_metrics_$q.txt"
        done
        grep -i "captured\|error\|Traceback" "$out/serve_$q.log" | head -5
        kill -TERM $pid; wait $pid
        step "serve $q $sv"
    done; done
fi
step "all done"
