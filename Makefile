# ddo-blocks: every command people, CI and the README use. `make help` lists them.
.DEFAULT_GOAL := help
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.deps-installed
EXT_STAMP := $(VENV)/.ext-built
RUST_SRC := $(shell find rust -name '*.rs' -o -name Cargo.toml) Cargo.toml pyproject.toml
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: help
help: ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements-dev.txt | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

$(EXT_STAMP): $(STAMP) $(RUST_SRC)
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/maturin develop --release -q
	touch $@

.PHONY: setup
setup: $(EXT_STAMP) ## create .venv, install dependencies, build the Rust extension

.PHONY: run
run: setup ## the main job: a staged pipeline on the embedded tiny model, with reports
	$(PY) -m ddo_blocks run $(ARGS)

.PHONY: test
test: setup ## build everything and run every test (cargo test + pytest); GPU tests skip without CUDA
	cargo test --workspace --exclude ddo-py -q
	$(PY) -m pytest -q

.PHONY: bench
bench: setup ## benchmarks on the GPU machine (see benchmarks/README.md)
	$(PY) -m benchmarks.run $(ARGS)

.PHONY: lint
lint: setup ## rustfmt, clippy (warnings denied), ruff
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(PY) -m pip install -q ruff && $(VENV)/bin/ruff check ddo_blocks tests pipelines benchmarks

.PHONY: clean
clean: ## remove build outputs and the environment
	rm -rf $(VENV) target ddo_blocks/_native*.so
