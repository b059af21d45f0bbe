# Two entry points for a fresh machine: `make train` and `make test`.
# Both create .venv on first use and are safe to re-run.

PYTHON ?= python3
VENV ?= .venv
# The torch build to install when the venv has none. Installed first, on its own, so that
# resolving the other dependencies never swaps in a different (e.g. multi-GB CUDA) build.
TORCH ?= torch==2.13.0
# Where that torch comes from; empty means PyPI. PyTorch's own index picks the build, e.g.
# https://download.pytorch.org/whl/cpu (CPU only) or https://download.pytorch.org/whl/cu128.
TORCH_INDEX_URL ?=
BIN := $(VENV)/bin

.PHONY: train test test-layouts lint typecheck install install-dev bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# What training needs: torch and the package's own dependencies, nothing for development.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)" \
		$(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)")
	$(BIN)/python -m pip install -q -e .
	touch $@

# The test and lint tools and the optional readers the tests exercise, on top.
$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

train: install
	$(BIN)/kempnerforge train configs/train/debug.toml

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# pyright[nodejs] brings its own Node.js; --pythonpath points it at this venv's torch.
typecheck: install-dev
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(BIN)/pyright --pythonpath $(BIN)/python

# pytest-xdist workers; a test keeps to one intra-op thread (tests/conftest.py), and tests
# that share a fixture wider than a test, or the SLURM tests' one cluster, share a worker
# (--dist loadgroup, in pyproject.toml's addopts). 0 runs the suite in this process.
TEST_WORKERS ?= 2

# The suite starts a few hundred fresh interpreters (torchrun's ranks, SLURM's jobs, the
# reference runs): compiling the checkout's modules once spares each of them compiling its
# imports again where PYTHONDONTWRITEBYTECODE is set (a clean clone has no bytecode).
test: lint typecheck
	$(BIN)/python -m compileall -q -j 0 kempnerforge tests bench examples
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

# Every parallel layout of 2 to 4 processes that validation accepts, for the dense, MoE and
# vision-language debug configs with and without accumulation, trained against one process
# (about half an hour on 2 cores); records what passed in tests/layouts/checked.txt.
test-layouts: install-dev
	$(BIN)/python -m tests.layouts.run_sweep

bench: install
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV) runs data
