# The serving image: `pagoda serve` on a CUDA runtime. Build from the repository root:
#   docker build -f docker/server.Dockerfile -t ghcr.io/pagoda-serving/pagoda-server:0.1.0 .
# torch from PyPI ships its own CUDA libraries; the runtime base supplies the driver-facing pieces
# (and the CUDA toolkit's ptxas that Triton uses is bundled with triton itself).
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONSAFEPATH=1 \
    VIRTUAL_ENV=/opt/pagoda \
    PATH=/opt/pagoda/bin:$PATH \
    TRITON_CACHE_DIR=/var/cache/pagoda/triton

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV"

WORKDIR /src
COPY pyproject.toml README.md* ./
COPY pagoda ./pagoda
COPY operator ./operator
COPY service ./service
COPY kernels ./kernels
# The local project: its dependency bounds live in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install ".[server]" \
    && useradd --uid 1000 --user-group --create-home --home-dir /home/pagoda pagoda \
    && mkdir -p /var/cache/pagoda/triton /models \
    && chown -R pagoda:pagoda /var/cache/pagoda

WORKDIR /home/pagoda
USER 1000:1000
EXPOSE 8000 8001
ENTRYPOINT ["pagoda", "serve"]
