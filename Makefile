# Every target sets itself up from nothing: a fresh machine needs only python3, cargo and g++.
# `make demo` and `make test` are the two commands the README starts with.

VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.deps-stamp
# Extras installed into the dev venv (see pyproject.toml [project.optional-dependencies]).
EXTRAS  ?= dev,engine,cli
# `make demo` installs numpy (the one hard dependency) and the cli extra (tqdm, matplotlib):
# no torch: 55 MB of wheels and about a minute on a fresh machine instead of 3.2 GB.
DEMO_EXTRAS := cli
DIST    ?= dist
export PYO3_PYTHON := $(abspath $(PY))
# What lint and test-python build first; `make test` empties it for its second stage, which
# runs after one build.
NEEDS_BUILD ?= build
# Release build of the extension, installed editable; PIP_QUIET keeps the pip that maturin runs
# to a line per problem instead of a line per package. Built for the host's explicit target
# triple: the wheel build (`.ci/build-dist`, zig) compiles for that triple too, so it finds
# most crates.io dependencies already built in target/<triple>/release (a fresh clone's wheel
# test then compiles about half as much).
HOST    := $(shell rustc -vV 2>/dev/null | sed -n 's/^host: //p')
DEVELOP := PIP_QUIET=1 VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release -q \
	$(if $(HOST),--target $(HOST))

.PHONY: all venv build demo demo-build run wheel test test-fast test-rust test-python test-wheel lint typecheck bench \
	bench-rust bench-python ptxas-report bench-gpu clean

all: test

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "maturin>=1.9,<2"
	touch $@

venv: $(STAMP)

# Release build of the extension, installed editable into the venv with the extras' dependencies.
# pip spends most of a fresh build unpacking torch and its CUDA wheels on one core, so the
# crates compile beside it: `maturin build` runs the cargo command `maturin develop` runs, with
# its environment, and develop then finds them built (it only checks the dependencies and
# installs). Under `make test` (WARM_RUST_TESTS) the same background job then builds `cargo
# test`'s binaries and runs clippy, with the arguments of test-rust and lint, on the core pip
# leaves idle. The background job's output is dropped: a failure shows again, with its
# message, in the step that repeats it.
BUILD_DEPS := $(VENV)/.build-deps.txt
WARM := $(VENV)/bin/maturin build --release -q $(if $(HOST),--target $(HOST)) \
	-i $(abspath $(PY)) -o target/warm-wheel
build: $(STAMP)
	@$(PY) .ci/build-deps.py $(EXTRAS) > $(BUILD_DEPS)
	@{ $(WARM) $(if $(WARM_RUST_TESTS),&& cargo test --no-run -q \
		&& cargo clippy -q --workspace --all-targets -- -D warnings); } >/dev/null 2>&1 & \
	warm=$$!; $(if $(WARM_EMULATOR),$(PY) tests/ops/emu_runtime.py opt >/dev/null 2>&1 & emu=$$!;) \
	$(PIP) install -q -r $(BUILD_DEPS); pip=$$?; wait $$warm $(if $(WARM_EMULATOR),$$emu); exit $$pip
	$(DEVELOP) -E $(EXTRAS)

# The release build with only the demo's dependencies; on a venv that `make build` set up the
# dev extras simply stay installed.
demo-build: $(STAMP)
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
# hash, so only after a change to cuda/) on the core pip leaves idle, instead of both test
# workers waiting for it at the start. (`make test`'s build keeps both cores busy already.)
test-fast: WARM_EMULATOR := 1
test-fast: build
	$(PY) -m pytest -q $(XDIST) -m "not slow and not wheel" --durations=10

# After the build, cargo test and the linters run beside the Python suite (-j3): alone they
# leave a core idle for long stretches (mypy and the last crates of each cargo build are one
# process), and the suite has its own idle moments (a worker waiting for the other's build of
# the emulator, the last file of the run). Each target's output is printed when it ends.
test: WARM_RUST_TESTS := 1
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
