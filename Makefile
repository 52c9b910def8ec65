# Coxswain: `make demo` sets everything up and runs the main job; `make test` runs the tests.
PY ?= python3

.PHONY: setup demo test lint gpu-test device-wheels

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

# Wheels for an offline CUDA machine whose Python lacks our pure-Python deps (the device
# tool's has torch/triton/transformers but not pydantic): carry .device/ and run
# `pip install --no-index --find-links .device/wheels pydantic` there.
device-wheels:
	$(PY) -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
		-d .device/wheels "pydantic>=2.6"
