# make serve | make test | make bench: each sets up .venv from pyproject.toml first (once, and
# again only when pyproject.toml changes).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specserve-installed
TORCH_VERSION ?= 2.13.0

# Extra arguments, e.g. SERVE_ARGS="--http-port 9000", TEST_ARGS='-m "not server"', BENCH_ARGS=--quick
SERVE_ARGS ?=
TEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: serve test bench venv clean-venv

venv: $(STAMP)

# torch first and pinned: an unpinned torch resolves to a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -e ".[dev]"
	touch $@

serve: $(STAMP)
	$(PY) -m backend.launcher $(SERVE_ARGS)

test: $(STAMP)
	$(PY) -m pytest $(TEST_ARGS)

bench: $(STAMP)
	$(PY) perf/bench_engine.py $(BENCH_ARGS)

clean-venv:
	rm -rf $(VENV)
