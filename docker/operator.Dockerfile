# The operator image: `pagoda operator` (kopf), no torch. Build from the repository root with BuildKit:
#   DOCKER_BUILDKIT=1 docker build -f docker/operator.Dockerfile -t ghcr.io/pagoda-serving/pagoda-operator:0.1.0 .
# BASE: any image with python3 and venv (the e2e suite uses a debootstrapped Debian). PIP_ARGS: e.g.
# "--no-index" to install only from docker/wheels/ (no network in the build).
ARG BASE=python:3.11-slim
# hadolint ignore=DL3006
FROM ${BASE}

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONSAFEPATH=1 \
    VIRTUAL_ENV=/opt/pagoda \
    PATH=/opt/pagoda/bin:$PATH

ARG PIP_ARGS=""
WORKDIR /src
# The local project (bind-mounted, not copied): its dependency bounds live in pyproject.toml.
# hadolint ignore=DL3013
RUN --mount=type=bind,rw,target=/src \
    python3 -m venv "$VIRTUAL_ENV" \
    && pip install ".[operator]" --find-links /src/docker/wheels -c docker/constraints.txt $PIP_ARGS \
    && useradd --uid 10001 --user-group --no-create-home pagoda

WORKDIR /tmp
USER 10001:10001
EXPOSE 8080 8081
ENTRYPOINT ["pagoda"]
CMD ["operator", "--liveness", "http://0.0.0.0:8080/healthz"]
