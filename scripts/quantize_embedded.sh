#!/usr/bin/env bash
# Quantize the embedded default model (SmolLM2-135M-Instruct) with llm-compressor's real flows:
# GPTQ W4A16 (symmetric, group 64), AWQ W4A16 (asymmetric, group 64) and FP8 dynamic, into
# ~/.cache/noisy-temp-server/real-quantizers/<name>/ (issue 41; docs/quality.md "Real quantizers").
#
#   scripts/quantize_embedded.sh [--only NAME ...]     (from the repository root)
#
# Runs scripts/quantize_embedded.py in the quantization venv $QUANT_VENV (default .venv-quant,
# built as scripts/make_quantized_fixtures.sh builds it: CPU torch==2.13.0, then
# llmcompressor==0.14.0.1, which pins compressed-tensors 0.19 and so cannot share the project's
# venv). The clean source is the project's embedded default, fetched and converted by the
# project's Python ($PROJECT_PYTHON, default .venv/bin/python). On 2 loaded CPU cores with one
# thread: fp8-dynamic a few seconds, GPTQ and AWQ tens of minutes (docs/quality.md).
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT_PYTHON=${PROJECT_PYTHON:-.venv/bin/python}
QUANT_VENV=${QUANT_VENV:-.venv-quant}
SOURCE=$(PYTHONPATH=. "$PROJECT_PYTHON" -c \
    "from noisy_temp_server.checkpoints.default_model import ensure_default_model; from noisy_temp_server.files import default_cache_dir; print(ensure_default_model(default_cache_dir()))" \
    | tail -n 1)
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$QUANT_VENV/bin/python" scripts/quantize_embedded.py "$SOURCE" "$@"
