#!/usr/bin/env bash
# Fills .whl with the wheels the GPU machine lacks (it has torch, triton and transformers, Python 3.12,
# no network): the serving stack's pure-Python and binary dependencies at the versions this venv runs,
# plus py-spy. bench/device_env.sh installs them there; carry ".whl" with every device call. Also writes
# out/tok, the tokenizer folder the bench/gpu_*.sh scripts take (the embedded SmolLM2's): carry "out/tok".
# Usage: bash bench/device_wheels.sh [VENV_PYTHON] (default .venv/bin/python)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${1:-$root/.venv/bin/python}
names="msgspec pyzmq fastapi starlette uvicorn httptools pydantic pydantic-core annotated-types typing-inspection
typing-extensions anyio opentelemetry-api grpcio grpcio-health-checking grpcio-reflection protobuf llguidance
prometheus-fastapi-instrumentator"
pins=$("$py" -m pip freeze | awk -F'==' -v names="$names" '
    BEGIN { n = split(names, list, " "); for (i = 1; i <= n; i++) want[tolower(list[i])] = 1 }
    { key = tolower($1); gsub("_", "-", key); if (key in want) print $1 "==" $2 }')
mkdir -p "$root/.whl"
platforms=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_26_x86_64
    --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64)
for pin in $pins py-spy; do  # this venv's version, else the newest the GPU machine's platform has
    "$py" -m pip download -q --no-deps --only-binary :all: --python-version 3.12 "${platforms[@]}" \
        -d "$root/.whl" "$pin" 2> /dev/null ||
        "$py" -m pip download -q --no-deps --only-binary :all: --python-version 3.12 "${platforms[@]}" \
            -d "$root/.whl" "${pin%%==*}"
done
ls "$root/.whl"
PYTHONSAFEPATH=1 "$py" -c "import sys, pathlib; from pagoda.service.model import write_default_tokenizer
print(write_default_tokenizer(pathlib.Path(sys.argv[1])))" "$root/out/tok"
