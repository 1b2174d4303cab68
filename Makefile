# `make bench`: the main job (python -m bench). `make test`: the test suite.
# Both create or reuse the virtual environment in $(VENV) and install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fused-block-installed

.PHONY: test bench compile-report clean-venv

$(STAMP): requirements-dev.txt setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m bench $(BENCH_ARGS)

compile-report: $(STAMP)
	$(PY) -m fused_block.kernels.aot

clean-venv:
	rm -rf $(VENV)
