# Common commands. `make serve` and `make test` are the README's quick start: each sets
# everything up first (idempotently) and works on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
export VLLM_CPU_KVCACHE_SPACE ?= 2
export VLLM_TARGET_DEVICE ?= cpu

.PHONY: setup setup-dev serve test test-fast lint typecheck bench calibrate clean

setup:
	scripts/setup.sh

setup-dev:
	scripts/setup.sh --dev

serve: setup
	$(VENV)/bin/noisy-temp-server serve $(ARGS)

test: setup-dev
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup-dev
	$(PY) -m pytest -m "not vllm and not default_model and not prometheus" $(PYTEST_ARGS)

lint: setup-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

bench: setup
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/quality.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
