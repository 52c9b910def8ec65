# Coxswain: `make demo` sets everything up and runs the main job; `make test` runs the tests.
PY ?= python3

.PHONY: setup demo test lint gpu-test

setup:
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"

demo: setup
	coxswain demo

test:
	$(PY) -m pytest -q tests/unit tests/integration tests/e2e

lint:
	ruff check services tests benchmarks && ruff format --check services tests benchmarks

# On a CUDA machine (the device tool): PYTHONPATH=. python3 -m pytest -q tests/gpu
gpu-test:
	PYTHONPATH=. $(PY) -m pytest -q tests/gpu
