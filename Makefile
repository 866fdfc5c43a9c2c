# radix-mlx: `make run-local` serves a model, `make test` runs the suite.
# Both set up everything they need: a venv, the project, and on Linux OpenBLAS.

VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.radix-mlx-installed
MODEL ?=
PORT ?= 30000
ARGS ?=
PYTEST_ARGS ?=
OPENBLAS := /usr/lib/$(shell uname -m)-linux-gnu/openblas-pthread/libblas.so.3

.PHONY: setup openblas prometheus clients run-local test test-fast lint format bench clean

setup: $(STAMP) openblas

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,clients]'
	@touch $(STAMP)

openblas:
	@if [ "$$(uname -s)" = "Linux" ] && [ ! -e "$(OPENBLAS)" ]; then \
	  if [ "$$(id -u)" = "0" ]; then \
	    echo "installing libopenblas0-pthread (10-40x faster float32 matmuls for mlx on CPU)"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread) >/dev/null \
	      || echo "warning: could not install libopenblas0-pthread; mlx falls back to reference BLAS"; \
	  else \
	    echo "note: run 'sudo apt-get install libopenblas0-pthread' for 10-40x faster prefill on CPU"; \
	  fi; \
	fi

# The agents' CLIs (Claude Code, Codex), exactly as tests/clients/package-lock.json pins
# them, into $(CLIENTS); Node from Debian when it is missing and we are root. Best effort:
# without them tests/test_cli_agents.py skips.
CLIENTS := .cache/clients
clients: $(CLIENTS)/.installed $(CLIENTS)/instructor/.installed

# instructor in a venv of its own: its jiter pin holds the openai SDK at an older release
# than the one the project's tests use (tests/clients/instructor.txt).
$(CLIENTS)/instructor/.installed: tests/clients/instructor.txt
	@test -x $(CLIENTS)/instructor/bin/python || $(PYTHON) -m venv $(CLIENTS)/instructor
	$(CLIENTS)/instructor/bin/python -m pip install -q -r tests/clients/instructor.txt \
	  && touch $@ || echo "warning: could not install instructor; its test will be skipped"

$(CLIENTS)/.installed: tests/clients/package.json tests/clients/package-lock.json
	@if ! command -v npm >/dev/null && [ "$$(uname -s)" = "Linux" ] && [ "$$(id -u)" = "0" ]; then \
	  echo "installing Node.js and npm (for the agents' CLIs the tests run)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm) >/dev/null \
	    || echo "warning: could not install nodejs and npm"; \
	fi
	@if command -v npm >/dev/null; then \
	  mkdir -p $(CLIENTS) && cp tests/clients/package.json tests/clients/package-lock.json $(CLIENTS)/ \
	  && npm ci --prefix $(CLIENTS) --no-audit --no-fund --loglevel=error && touch $@ \
	  || echo "warning: npm ci failed; the CLI agent tests will be skipped"; \
	else echo "note: no npm; the CLI agent tests will be skipped"; fi

# Best effort: the metrics tests start a real Prometheus when one is installed.
prometheus:
	@if [ "$$(uname -s)" = "Linux" ] && ! command -v prometheus >/dev/null && [ "$$(id -u)" = "0" ]; then \
	  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
	    || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus)) \
	    >/dev/null 2>&1 || echo "note: prometheus not installed; its test will be skipped"; \
	fi

run-local: setup
	@model="$(MODEL)"; \
	if [ -z "$$model" ]; then model=$$($(PY) -c 'from common.tiny_model import ensure_tiny_model; print(ensure_tiny_model())'); fi; \
	echo "serving $$model on http://127.0.0.1:$(PORT)"; \
	exec $(VENV)/bin/radix-mlx serve --model-path "$$model" --port $(PORT) $(ARGS)

test: setup prometheus clients
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: setup prometheus
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: setup
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m benchmarks.scheduler_micro
	$(PY) -m benchmarks.hop
	$(PY) -m benchmarks.one_batch --preset small --batch-size 1 8 --input-len 256 --output-len 64 --rounds 5 --compare-mlx-lm
	$(PY) -m benchmarks.one_batch --preset small --batch-size 8 --cached-prefix-len 1984 --input-len 64 --output-len 64 --rounds 5 --kv-cache-dtype auto int8 int4
	$(PY) -m benchmarks.families
	$(PY) -m benchmarks.restart
	$(PY) -m benchmarks.decode_floor --preset medium --context 1024 8192
	$(PY) -m benchmarks.serving --suite standard
	$(PY) -m benchmarks.serving --suite speculative
	$(PY) -m benchmarks.serving --suite agent-sessions
	$(PY) -m benchmarks.routing --preset tiny --dp-size 2
	$(PY) -m benchmarks.one_batch --preset small --batch-size 8 --input-len 128 --output-len 64 --loras 4 --rounds 7
	$(PY) -m benchmarks.model_switch --rounds 4
	$(PY) -m benchmarks.model_load --rounds 4

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
