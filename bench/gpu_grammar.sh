#!/usr/bin/env bash
# Structured output on one CUDA GPU (the device machine has torch but not this package; llguidance
# comes from the carried wheel in .whl): the CUDA grammar mask against the CPU one, then
# `pagoda bench grammar` on the random Llama-3.1-8B-shaped checkpoint (128k vocabulary) that
# gpu_engine.sh builds. Usage: bash bench/gpu_grammar.sh TOKENIZER_DIR OUT_DIR
set -uo pipefail
tok=${1:?tokenizer folder}; out=${2:?output folder}
# shellcheck source=bench/device_env.sh
source "$(dirname "$0")/device_env.sh"
python3 - <<'PY' 2>&1 | tee "$out/grammar_mask.log"
import numpy as np, torch
from pagoda.service.engine.runner.sampler import Sampler, apply_token_bitmask
rng = np.random.default_rng(0)
for rows, vocab in ((16, 49152), (256, 128256)):
    bitmask = rng.integers(-(2**31), 2**31, size=(rows, (vocab + 31) // 32), dtype=np.int32)
    logits = torch.randn(2 * rows, vocab, device="cuda")
    picked = list(range(0, 2 * rows, 2))
    cpu = apply_token_bitmask(logits.cpu(), picked, bitmask)
    cuda = apply_token_bitmask(logits.clone(), picked, bitmask).cpu()
    staged = Sampler(vocab, set()).stage_bitmask(bitmask, logits.device)  # page-locked, as in a step
    cuda_staged = apply_token_bitmask(logits.clone(), picked, bitmask, staged).cpu()
    assert torch.equal(cuda, cpu) and torch.equal(cuda_staged, cpu), (rows, vocab)
    print(f"PASS grammar mask, {rows} of {2 * rows} rows x {vocab} tokens: CUDA (pageable, pinned) == CPU")
PY
ensure_8b "$tok"
for batch in 16 64; do
    python3 -m pagoda.bench grammar --model /tmp/llama-8b-random --dtype bfloat16 --batch "$batch" \
        --output-len 64 --output "$out/grammar.md" 2>&1 | tee -a "$out/grammar.log" | grep -v Loading
done
