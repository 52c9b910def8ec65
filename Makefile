# Coxswain: `make demo` sets everything up and runs the main job; `make test` runs the tests.
PY ?= python3

.PHONY: setup demo test lint proto gpu-test offline-bundle device-wheels

# System packages: redis-server (the controller and `coxswain up`; tests start their own) and
# chromium (the dashboard's browser test), from Debian when missing and we may install them.
# The installers run quietly (a first run takes a few minutes), so each step says what it does.
setup:
	@missing=""; command -v redis-server >/dev/null || missing="redis-server"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	missing="$${missing# }"; \
	if [ -z "$$missing" ]; then \
		echo "==> redis-server and chromium: already installed"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "==> installing $$missing (apt-get)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else echo "==> please install: $$missing (e.g. sudo apt-get install -y $$missing)"; fi
	@if $(PY) -c "import torch" 2>/dev/null; then echo "==> torch: already installed"; \
	else echo "==> installing torch 2.13.0 (pip)"; $(PY) -m pip install -q "torch==2.13.0"; fi
	@echo "==> installing coxswain and its Python dependencies, dev tools included (pip)"
	@$(PY) -m pip install -q -e ".[dev]"

# The local cluster (Redis, Ray, Serve gateway + engine, patch store, controller) on the
# embedded tiny model, then a tour of it over HTTP and gRPC; `coxswain down` stops it.
demo: setup
	@echo "==> starting the local cluster on the tiny model (coxswain up --tiny --device cpu)"
	@coxswain up --tiny --device cpu
	@echo "==> touring it over HTTP and gRPC (coxswain demo --cluster)"
	@coxswain demo --cluster

# Two pytest-xdist workers, one test file at a time each (`--dist loadfile`), so a file's
# module-scoped Ray and cluster start once, as in one process; every test starts its own Ray
# and Redis on free ports, so the workers never meet. Most of the suite waits (on Ray, on
# subprocesses), so two workers pay off on 2 cores. The slowest files (e2e) go out first.
test:
	$(PY) -m pytest -q -n 2 --dist loadfile tests/e2e tests/integration tests/unit

lint:
	ruff check services tests benchmarks && ruff format --check services tests benchmarks

# gRPC code from proto/coxswain/v1/*.proto into services/proto/coxswain/v1/ (committed, so
# users need no grpcio-tools). The generator's version sets the floors in pyproject.toml
# (protobuf >= its gencode version, grpcio >= its own): bump them together. protoc writes
# `from coxswain.v1 import`; the sed makes that the `services` package path.
GRPC_TOOLS_VERSION := 1.78.0
PROTO_OUT := services/proto

proto:
	@$(PY) -c "from importlib.metadata import version as v; import sys; \
		sys.exit(0 if v('grpcio-tools') == '$(GRPC_TOOLS_VERSION)' else \
		'make proto needs grpcio-tools==$(GRPC_TOOLS_VERSION) (pip install -e .[dev]), found ' + v('grpcio-tools'))"
	$(PY) -m grpc_tools.protoc -I proto --python_out=$(PROTO_OUT) --pyi_out=$(PROTO_OUT) \
		--grpc_python_out=$(PROTO_OUT) proto/coxswain/v1/*.proto
	sed -i.orig 's/^from coxswain\.v1 import/from services.proto.coxswain.v1 import/' \
		$(PROTO_OUT)/coxswain/v1/*_pb2*.py $(PROTO_OUT)/coxswain/v1/*_pb2.pyi
	rm -f $(PROTO_OUT)/coxswain/v1/*.orig

# On a CUDA machine (the device tool): tests/gpu and the bf16 tests that run on CPU and CUDA
# alike (GPU_TESTS: a part of them, e.g. tests/gpu/test_parallel_nccl.py)
GPU_TESTS ?= tests/gpu tests/integration/test_oracle_bf16.py tests/integration/test_steering_bf16.py
gpu-test:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m pytest -q $(GPU_TESTS)

# Everything a CUDA host without internet access needs beside its own PyTorch, built into
# .device/ on a machine with it (same arch, Debian/Ubuntu for redis-server): the wheels of
# deploy/offline/requirements.txt, Ray trimmed to Serve (ray.tar.xz) and redis-server. On the
# host: `deploy/offline/install.sh` (README: "GPU hosts without internet access").
PYVER ?= 3.12

offline-bundle:
	PY=$(PY) PYVER=$(PYVER) bash deploy/offline/build.sh

device-wheels: offline-bundle
