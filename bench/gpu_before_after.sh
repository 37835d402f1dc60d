#!/usr/bin/env bash
# The same GPU figures for two trees of this repository in one call, one after the other on one GPU:
# the offline engine (batch-1 decode 1000/200 and 256 x 128/128, bf16 and fp8) and `pagoda serve` at
# concurrency 1 and 64, each through that tree's own bench/gpu_speed.sh, so a refactor (issue 32's
# layout) is measured by the commands it was measured with before. The checkpoint is built once.
# BEFORE is a checkout of the older commit (`git worktree add --detach .before COMMIT`; carry it with
# .whl and out/tok). CHECK=1 first runs this tree's GPU correctness checks (fp32 greedy against
# transformers, graphs against eager, async against in-turn, the sampler against transformers).
# Usage: bash bench/gpu_before_after.sh TOKENIZER_DIR OUT_DIR BEFORE_TREE [ORDER] (ORDER: "before after")
set -uo pipefail
tok=$(realpath "${1:?tokenizer folder}"); out=$(realpath "${2:?output folder}")
before=$(realpath "${3:?the older tree}"); order=${4:-before after}
root=$(cd "$(dirname "$0")/.." && pwd)
export PAGODA_WHL_DIR=$root/.whl BS1_PRECISIONS=${BS1_PRECISIONS:-bf16 fp8} SERVE_CONCURRENCY=${SERVE_CONCURRENCY:-1 64}
export OFFLINE_VARIANTS=${OFFLINE_VARIANTS:- ;--quantization fp8}
sections="bs1 offline serve"
if [ "${CHECK:-0}" = 1 ]; then
    mkdir -p "$out/check"
    bash "$root/bench/gpu_speed.sh" "$tok" "$out/check" check || exit 1
fi
for which in $order; do
    tree=$root; [ "$which" = before ] && tree=$before
    mkdir -p "$out/$which"
    echo "#### $which: $(cat "$tree/.commit" 2> /dev/null || echo "$tree")"
    bash "$tree/bench/gpu_speed.sh" "$tok" "$out/$which" "$sections"
done
