# Two entry points for a fresh machine: `make demo` and `make test`. Each installs what it needs
# into .venv (Python 3.10/3.11; MindSpore 2.10 needs numpy < 2, pinned in pyproject.toml).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

.PHONY: demo demo-quick test test-fast bench clean npm

# pip runs quietly (-q): each step says first what it installs and why it takes a while.
$(VENV)/.base: pyproject.toml setup.py mspretrain/data/_bpe.c mspretrain/prepare/_minhash.c mspretrain/prepare/_sample.c
	@test -x $(PY) || { echo "make: creating the virtual environment $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@echo "make: upgrading pip in $(VENV)"
	$(PIP) install --upgrade pip
	@echo "make: installing mspretrain (editable) and its dependencies into $(VENV): MindSpore 2.10 (~1 GB), numpy<2,"
	@echo "      sentencepiece, safetensors, matplotlib, ... and our C BPE encoder; a few minutes on a fresh machine"
	$(PIP) install -e .
	@touch $@

# --no-compile: pip would byte-compile all ~12,000 modules of torch, transformers, ray, sympy, ...;
# the tests import about a fifth of them, compiled at their first import (docs/benchmarks.md,
# "The test suite": ~24 s of the 29 s of CPU pip spent on transformers + sympy + networkx alone).
$(VENV)/.test: $(VENV)/.base pyproject.toml
	@echo "make: installing the test dependencies into $(VENV): pytest, pytest-xdist, hypothesis, torch (CPU, ~200 MB), transformers, ruff, ray, lm-eval"
	$(PIP) install --no-compile -e '.[test]'
	@touch $@

# The demo fetches its corpus with `npm pack` (npm registry only); install npm if it is missing.
npm:
	@command -v npm >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq npm; } \
	  || { echo "error: npm is needed to fetch the demo corpus — install Node.js/npm, or run: $(VENV)/bin/mspretrain prepare YOUR_TEXT --out data"; exit 2; }

demo: $(VENV)/.base npm
	$(VENV)/bin/mspretrain demo

demo-quick: $(VENV)/.base npm
	$(VENV)/bin/mspretrain demo --quick

# Two pytest-xdist workers, one per core (much of the suite is one thread at a time: graph
# compilation, Python, waits on subprocesses). --dist loadfile: a worker takes a whole test file at
# a time (its module fixtures built once), the next when it is done; jobs that launch ranks hold one
# lock, so two msrun jobs never run at once, and the shared session runs are built once for both
# workers (tests/conftest.py `one_msrun_at_a_time`, `built_once`); conftest puts the files with long
# jobs first (hence --no-loadscope-reorder) and hands the files that launch ranks to one worker at a
# time while the other has any other file to run (tests/helpers/schedule.py). One process instead: `.venv/bin/python -m pytest`.
# PYTHONDONTWRITEBYTECODE unset: every test starts Python processes (msrun workers, CLI runs, Ray
# workers) that should cache the bytecode they compile; where it is set (this project's CI machines
# set it), each compiles all it imports from source, every time (~9 s of CPU for torch + transformers
# in each worker; docs/benchmarks.md, "The suite's time: bytecode, the final eval, one probe process").
# Lint first ([tool.ruff] in pyproject.toml): it takes a second and names the line of a real bug
# (an undefined name, an unused import) before the suite spends minutes compiling graphs.
TEST_WORKERS ?= 2
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

test: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(PYTEST)

# The inner loop while editing: everything but the end-to-end runs, msrun and the SIGKILL tests
# (markers in pyproject.toml). CI and a change that is ready to land run `make test`.
test-fast: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(PYTEST) -m "not slow and not msrun and not sigkill"

bench: $(VENV)/.test
	$(PY) benchmarks/prepare_bench.py
	$(PY) benchmarks/loader_bench.py
	$(PY) benchmarks/train_bench.py

clean:
	rm -rf $(VENV) mspretrain-demo .pytest_cache
