# Every target sets itself up from nothing: a fresh machine needs only python3, cargo and g++.
# `make demo` and `make test` are the two commands the README starts with.

VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.deps-stamp
# Extras installed into the dev venv (see pyproject.toml [project.optional-dependencies]).
EXTRAS  ?= dev,engine,cli
export PYO3_PYTHON := $(abspath $(PY))

.PHONY: all venv build demo test test-rust test-python lint bench bench-rust bench-python \
	ptxas-report bench-gpu clean

all: test

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "maturin>=1.9,<2"
	touch $@

venv: $(STAMP)

# Release build of the extension, installed editable into the venv with the extras' dependencies.
build: $(STAMP)
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release -q -E $(EXTRAS)

demo: build
	$(VENV)/bin/kvblocks simulate

lint: build
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(VENV)/bin/ruff check python tests benches
	$(VENV)/bin/ruff format --check python tests benches

test-rust:
	cargo test

test-python: build
	$(PY) -m pytest -q

test: build test-rust lint test-python

bench-rust:
	cargo bench -p kvblocks-core

bench-python: build
	$(PY) -m pytest benches --benchmark-only

bench: bench-rust bench-python

# Registers, spills and shared memory per kernel (NVRTC, no GPU needed).
ptxas-report: build
	$(PY) benches/ops/ptxas_report.py sm_80 sm_90

# Decode/prefill time and fraction of HBM bandwidth; needs a CUDA GPU and CuPy.
bench-gpu: build
	$(PY) benches/ops/bench_gpu.py

clean:
	rm -rf $(VENV) target
