# The operator: `specfleet operator`, the SpecDecodeDeployment controller (kopf). Slim Python, no
# torch (a test imports the operator with torch blocked). Runs as uid 65532. docs/images.md.
#
#   docker build -f docker/operator.Dockerfile -t ghcr.io/specfleet/operator:0.1.0 .
FROM python:3.12-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp

WORKDIR /opt/specfleet
# One distribution: setuptools finds the packages in these folders (pyproject.toml); only the
# base dependencies are installed, none of the worker extra.
COPY pyproject.toml README.md ./
COPY api/ api/
COPY bench/ bench/
COPY cli/ cli/
COPY control/ control/
COPY local/ local/
COPY operator/ operator/
COPY proto/ proto/
COPY router/ router/
COPY worker/ worker/

RUN pip install --no-cache-dir . \
    && groupadd --gid 65532 specfleet \
    && useradd --uid 65532 --gid 65532 --no-log-init --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin specfleet

USER 65532:65532
# Prometheus metrics (also the liveness probe)
EXPOSE 8081
ENTRYPOINT ["specfleet", "operator"]
