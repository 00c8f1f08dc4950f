# Every target sets itself up from nothing: a fresh machine needs only python3, cargo and g++.
# `make demo` and `make test` are the two commands the README starts with.

VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
UV      := $(VENV)/bin/uv
STAMP   := $(VENV)/.deps-stamp
# Extras installed into the dev venv (see pyproject.toml [project.optional-dependencies]).
EXTRAS  ?= dev,engine,cli
# `make demo` installs numpy (the one hard dependency) and the cli extra (tqdm, matplotlib):
# no torch: 55 MB of wheels instead of 3.2 GB.
DEMO_EXTRAS := cli
DIST    ?= dist
export PYO3_PYTHON := $(abspath $(PY))
# Python keeps the bytecode it compiles, whatever the environment says: uv installs no .pyc
# files, so with PYTHONDONTWRITEBYTECODE set (as on the machines this targets) every test
# process compiled torch, transformers and kvblocks from source again (about 2.6 CPU-s each,
# some 80 processes), and pytest re-rewrote every test module in each one. The bytecode goes
# into __pycache__ directories (gitignored) in the venv and the tree.
unexport PYTHONDONTWRITEBYTECODE
# What lint and test-python build first; `make test` empties it for its second stage, which
# runs after one build.
NEEDS_BUILD ?= build
# Release build of the extension, installed editable. Packages are installed by uv (from
# PyPI, into the venv): it fetches and unpacks the 3.2 GB of wheels in parallel, about 15 s
# on a fresh machine where pip took 86 s on one core. Built for the host's explicit target
# triple: the wheel build (`.ci/build-dist`) compiles for that triple too, with the same
# settings (zig links only the extension there), so it finds every crates.io dependency
# already built in target/<triple>/release and compiles only the two crates of the unpacked
# sdist (a fresh clone's wheel test: 30-32 CPU-s instead of 61-62).
HOST    := $(shell rustc -vV 2>/dev/null | sed -n 's/^host: //p')
DEVELOP := PATH=$(abspath $(VENV))/bin:$$PATH VIRTUAL_ENV=$(abspath $(VENV)) \
	$(VENV)/bin/maturin develop --uv --release -q \
	$(if $(HOST),--target $(HOST))

.PHONY: all venv build demo demo-build run wheel test test-fast test-rust test-python test-wheel lint typecheck bench \
	bench-rust bench-python ptxas-report bench-gpu clean

all: test

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q "maturin>=1.9,<2" "uv>=0.4"
	touch $@

# A venv made before uv installed the packages gets it here.
$(UV): | $(STAMP)
	$(PIP) install -q "uv>=0.4"

venv: $(STAMP) $(UV)

# Release build of the extension, installed editable into the venv with the extras' dependencies.
# The crates compile while uv installs the wheels: `maturin build` runs the cargo command
# `maturin develop` runs, with its environment, and develop then finds them built (it only
# checks the dependencies and installs). The background job's output is dropped: a failure
# shows again, with its message, in develop.
BUILD_DEPS := $(VENV)/.build-deps.txt
WARM := $(VENV)/bin/maturin build --release -q $(if $(HOST),--target $(HOST)) \
	-i $(abspath $(PY)) -o target/warm-wheel
build: $(STAMP) $(UV)
	@$(PY) .ci/build-deps.py $(EXTRAS) > $(BUILD_DEPS)
	@$(WARM) >/dev/null 2>&1 & warm=$$!; \
	$(if $(WARM_EMULATOR),$(PY) tests/ops/emu_runtime.py opt >/dev/null 2>&1 & emu=$$!;) \
	$(UV) pip install -q --python $(PY) -r $(BUILD_DEPS); rc=$$?; \
	wait $$warm $(if $(WARM_EMULATOR),$$emu); exit $$rc
	$(DEVELOP) -E $(EXTRAS)

# The release build with only the demo's dependencies; on a venv that `make build` set up the
# dev extras simply stay installed.
demo-build: $(STAMP) $(UV)
	$(DEVELOP) -E $(DEMO_EXTRAS)

demo: demo-build
	$(VENV)/bin/kvblocks simulate

# Any kvblocks command in the venv, e.g. make run ARGS="simulate --policy lpm".
run: demo-build
	$(VENV)/bin/kvblocks $(ARGS)

# sdist + manylinux2014 abi3 wheel in $(DIST), the wheel built from the unpacked sdist.
$(VENV)/.zig-stamp: $(STAMP)
	$(PIP) install -q "ziglang>=0.13"
	touch $@

wheel: $(VENV)/.zig-stamp
	PYTHON=$(abspath $(PY)) .ci/build-dist $(DIST)

lint: $(NEEDS_BUILD)
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(VENV)/bin/ruff check python tests benches
	$(VENV)/bin/ruff format --check python tests benches
	$(PY) -m mypy --strict python/kvblocks tests/test_protocols.py

# mypy --strict over the package (pyproject's [tool.mypy]) and the protocol conformance test
# (also part of `lint`).
typecheck: build
	$(PY) -m mypy --strict python/kvblocks tests/test_protocols.py

test-rust:
	cargo test

# pytest-xdist: two workers (the machines this targets have 2 cores), each test file on one
# worker (the oracles' coverage counters are per module).
XDIST   ?= -n 2 --dist loadfile

# The complete suite (what CI runs); the slowest tests are listed at the end.
test-python: $(NEEDS_BUILD)
	$(PY) -m pytest -q $(XDIST) --durations=15

# The fast tier, for iteration: all but the `slow` and `wheel` markers (the full NVRTC
# matrix, sanitizer builds, emulation at scale, the wheel test), on two pytest workers.
# Its build also compiles the CUDA emulator (WARM_EMULATOR; kept in cuda/emu/build by source
# hash, so only after a change to cuda/) beside the crates and uv, instead of both test
# workers waiting for it at the start. (In `make test` cargo test and the linters fill that time.)
test-fast: WARM_EMULATOR := 1
test-fast: build
	$(PY) -m pytest -q $(XDIST) -m "not slow and not wheel" --durations=10

# After the build, cargo test and the linters run beside the Python suite (-j3): alone they
# leave a core idle for long stretches (mypy and the last crates of each cargo build are one
# process), and the suite has its own idle moments (a worker waiting for the other's build of
# the emulator, the last file of the run). Each target's output is printed when it ends.
test: build
	$(MAKE) --no-print-directory -j3 --output-sync=target NEEDS_BUILD= test-rust lint test-python

# Only the distribution test (also part of test-python): build, install in a fresh venv, run.
test-wheel: build
	$(PY) -m pytest -q -m wheel tests/distribution

bench-rust:
	cargo bench -p kvblocks-bench

bench-python: build
	$(PY) -m pytest benches --benchmark-only

bench: bench-rust bench-python

# Registers, spills and shared memory per kernel (NVRTC, no GPU needed).
ptxas-report: build
	$(PY) benches/ops/ptxas_report.py sm_80 sm_90

# Static performance model from the SASS (NVRTC + nvdisasm, no GPU): warp-instructions per
# K/V tile by class, bytes, occupancy, modeled fraction of HBM / tensor-core peak.
.PHONY: kernel-model
kernel-model: build
	$(PY) benches/ops/kernel_model.py

# Decode/prefill time and fraction of HBM bandwidth; needs a CUDA GPU and CuPy.
bench-gpu: build
	$(PY) benches/ops/bench_gpu.py

clean:
	rm -rf $(VENV) target $(DIST)
