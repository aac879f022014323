# The operator: `specfleet operator`, the SpecDecodeDeployment controller (kopf). Slim Python, no
# torch (a test imports the operator with torch blocked). Runs as uid 65532. docs/images.md.
#
#   docker build -f docker/operator.Dockerfile -t ghcr.io/specfleet/operator:0.1.0 .
# An exact release, not a moving minor tag; docs/images.md says how to pin its digest too.
FROM python:3.12.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp

WORKDIR /opt/specfleet
# One distribution: setuptools finds the packages in these folders (pyproject.toml); only the
# base dependencies are installed, none of the worker extra.
COPY pyproject.toml README.md ./
COPY docker/constraints.txt docker/
COPY api/ api/
COPY bench/ bench/
COPY cli/ cli/
COPY control/ control/
COPY local/ local/
COPY operator/ operator/
COPY proto/ proto/
COPY router/ router/
COPY worker/ worker/

# Exact versions (docker/constraints.txt): PIP_CONSTRAINT, unlike -c, also pins setuptools in the
# isolated build of this distribution.
RUN PIP_CONSTRAINT=/opt/specfleet/docker/constraints.txt pip install --no-cache-dir . \
    && groupadd --gid 65532 specfleet \
    && useradd --uid 65532 --gid 65532 --no-log-init --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin specfleet

USER 65532:65532
# Prometheus metrics (also the liveness probe)
EXPOSE 8081
ENTRYPOINT ["specfleet", "operator"]
