# The operator image: `pagoda operator` (kopf) on slim Python, no torch. Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/pagoda-serving/pagoda-operator:0.1.0 .
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONSAFEPATH=1

WORKDIR /src
COPY pyproject.toml README.md* ./
COPY pagoda ./pagoda
COPY operator ./operator
COPY service ./service
COPY kernels ./kernels
# The local project: its dependency bounds live in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install ".[operator]" \
    && useradd --uid 10001 --user-group --no-create-home pagoda

WORKDIR /tmp
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["pagoda"]
CMD ["operator", "--liveness", "http://0.0.0.0:8080/healthz"]
