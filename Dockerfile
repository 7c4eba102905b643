# syntax=docker/dockerfile:1
#
# GPU image (default):  docker build -t indexer-service:0.1.0-cuda .
# CPU image:            docker build --build-arg VARIANT=cpu -t indexer-service:0.1.0-cpu .
#
# Both variants compile the default model's warmup set into TRITON_CACHE_DIR at build time, in this very image,
# so a pod's warmup loads kernels (about 1 ms a key) instead of compiling them. A cache built anywhere else
# (another image, another Triton or CUDA) is not hit: Triton's cache key covers the whole toolchain.

ARG VARIANT=gpu
# The GPU base carries a CUDA build of torch and the Triton it was released with: torch 2.11 + Triton 3.6 is the
# toolchain the project's GPU tests run on (H200). Pin it by digest in production.
ARG GPU_BASE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime
ARG CPU_BASE=python:3.11-slim-bookworm

FROM ${GPU_BASE} AS base-gpu

FROM ${CPU_BASE} AS base-cpu
# The README's first install step. From the CPU index, because PyPI's Linux torch is a multi-GB CUDA build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN python -m pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# The variant's stage, tagged through its base above: DL3006 cannot follow a stage name built from an ARG.
# hadolint ignore=DL3006
FROM base-${VARIANT}
ARG WARMUP_TARGET=cuda:90
LABEL org.opencontainers.image.title="indexer-service" \
      org.opencontainers.image.description="DeepSeek-V4 sparse-indexer prefill chunk metadata over gRPC, warmup-gated readiness" \
      org.opencontainers.image.licenses="Apache-2.0"

# glibc malloc is tuned by the service itself (malloc_arena_max, malloc_retain_bytes in docs/service.md).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/indexer \
    TRITON_CACHE_DIR=/opt/indexer/triton-cache

RUN groupadd --gid 10001 indexer \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/indexer --shell /usr/sbin/nologin indexer \
    && mkdir -p /opt/indexer/triton-cache \
    && chown indexer:indexer /opt/indexer/triton-cache

# A C compiler and the C library's headers: `pip install .` builds service/fastpath.c, and on a GPU Triton compiles
# its launcher stub at run time (runtime images need not carry one). Versions follow the base image's release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/indexer/src
COPY pyproject.toml setup.py README.md ./
COPY kernels ./kernels
COPY protos ./protos
COPY service ./service
# The README's second install step. torch is already there (base image or the step above), so the range in
# pyproject.toml only checks it and pip never swaps it for another build.
RUN python -m pip install --no-cache-dir .

USER 10001:10001
WORKDIR /home/indexer
# Compiled as the serving user, into the serving image, with the GPU hidden: the compile engine then runs
# Triton's whole compiler ahead of time for WARMUP_TARGET, so the build needs no GPU and the cache is the one
# the server's warmup looks up. The cache directory stays writable: the first GPU start adds its launcher stub.
RUN CUDA_VISIBLE_DEVICES="" indexer-service precompile --target "${WARMUP_TARGET}" --cache-dir "${TRITON_CACHE_DIR}"

# gRPC (PrefillMetadata, grpc.health.v1, reflection) and HTTP (/metrics, /livez, /readyz).
EXPOSE 50051 8080
# For docker and compose; Kubernetes ignores this and uses the gRPC probes in deploy/base/deployment.yaml.
HEALTHCHECK --interval=15s --timeout=10s --start-period=5m --retries=3 \
    CMD ["/bin/sh", "-c", "indexer-service check \"127.0.0.1:${INDEXER_GRPC_PORT:-50051}\""]

# The server handles SIGTERM itself (NOT_SERVING, drain, exit 0), so it runs as PID 1 with no shell in between.
ENTRYPOINT ["indexer-service"]
CMD ["serve"]
