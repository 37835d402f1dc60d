# shellcheck shell=bash
# Sourced by the bench/gpu_*.sh scripts on the GPU machine, which has torch/triton/transformers but
# neither this package nor some of its dependencies: installs the wheels carried in .whl (msgspec,
# pyzmq, FastAPI, uvicorn, pydantic, newer grpc/protobuf; see /work/.library/device/README.md) and
# puts a `pagoda` package shim on PYTHONPATH. Sets `root` to the repository. `bash bench/device_wheels.sh`
# fills .whl.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# PAGODA_WHL_DIR: the wheels' folder when this tree is a copy without them (default: the repo's .whl).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${PAGODA_WHL_DIR:-$root/.whl}"/*.whl || exit 1
shim=$(mktemp -d)/p
mkdir -p "$shim/pagoda" && cp "$root"/pagoda/*.py "$shim/pagoda/" && ln -s "$root/pagoda/bench" "$shim/pagoda/bench" && ln -s "$root/pagoda/devtools" "$shim/pagoda/devtools"
for d in kernels service operator; do ln -s "$root/$d" "$shim/pagoda/$d"; done
export PYTHONPATH=/tmp/site:$shim PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
# What the bench/gpu_*.sh scripts share: `step NAME` prints the seconds since this file was sourced;
# `ensure_8b TOKENIZER_DIR` builds the Llama-3.1-8B-shaped random checkpoint at /tmp/llama-8b-random
# once per machine (a later call on a warm machine finds it).
start=$SECONDS
step() { echo "== $1 after $((SECONDS - start)) s"; }
ensure_8b() {
    [ -f /tmp/llama-8b-random/config.json ] ||
        python3 -m pagoda.bench.gpu_check --tokenizer "$1" --build-8b /tmp/llama-8b-random 2>&1 | tail -1
}
