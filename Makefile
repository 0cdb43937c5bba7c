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

# REUSE_TORCH=1: a venv over $(PYTHON)'s own site packages, keeping the torch installed there (no
# second download of PyPI's CUDA build, about 5.9 GB); everything else is installed as pinned.
REUSE_TORCH ?=
VENV_ARGS := $(if $(REUSE_TORCH),--system-site-packages,)

$(PY):
	$(PYTHON) -m venv $(VENV_ARGS) $(VENV)

# Disk the install needs, measured on a fresh 2-core machine (2026-12-03): PyPI's CUDA torch peaks at
# 8.9 GB while pip holds the downloaded wheels beside the unpacked venv (5.9 GB left), under 1 GB
# with REUSE_TORCH. --no-cache-dir keeps pip from writing a third copy into its cache.
NEED_GB := $(if $(REUSE_TORCH),1,9)
PIP_INSTALL := $(PY) -m pip install -q --no-cache-dir

$(STAMP): requirements-dev.txt | $(PY)
	@free=$$(df -Pk $(VENV) | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ "$$free" -lt $(NEED_GB) ]; then \
		echo "make: warning: $$free GB free on the disk of $(VENV); the install needs about $(NEED_GB) GB" \
			"(PyPI's torch is the CUDA build). Free some space, or reuse an installed torch:" \
			"make $(or $(MAKECMDGOALS),run) REUSE_TORCH=1 PYTHON=/path/to/python" >&2; \
	fi
	$(PIP_INSTALL) --upgrade pip
	$(if $(REUSE_TORCH),grep -v '^torch==' requirements-dev.txt > $(VENV)/requirements.txt,cp requirements-dev.txt $(VENV)/requirements.txt)
	$(PIP_INSTALL) -r $(VENV)/requirements.txt
	touch $@

$(EXT_STAMP): $(STAMP) $(RUST_SRC)
	set -o pipefail; VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH \
		$(VENV)/bin/maturin develop --release -q 2>&1 | { grep -v '^Requirement already satisfied' || true; }
	touch $@

.PHONY: setup
setup: $(EXT_STAMP) ## create .venv, install dependencies, build the Rust extension

.PHONY: wheel
wheel: $(STAMP) ## build the abi3 wheel into dist/ (pip install dist/ddo_blocks-*.whl: no Rust needed there)
	$(VENV)/bin/maturin build --release --out dist -q

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
