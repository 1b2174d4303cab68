# `make bench`: the main job (python -m bench). `make test`: the test suite.
# Both create or reuse the virtual environment in $(VENV) and install what they need.
# `make compile-report`: the compiled-kernel resource table (every config, sm_80 and sm_90), then
# each sm_90 config's SASS cost per loop (instructions, HGMMA, issue/tensor; kernels/sass.py).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fused-block-installed

.PHONY: test bench compile-report clean-venv

# The package itself installs offline, as on the GPU machine: no index, no build isolation.
$(STAMP): requirements-dev.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-index --no-deps --no-build-isolation -e .
	touch $(STAMP)

# TESTS narrows the run (e.g. TESTS=tests/test_install.py); PYTEST_ARGS sets pytest's options:
# by default two worker processes (pytest-xdist), so the interpreter tests run beside the
# compile check's ahead-of-time compiles (once per run: the conftest's run_once); PYTEST_ARGS=
# runs in one process.
TESTS ?= tests
PYTEST_ARGS ?= -n 2
# --durations: every run lists its 25 slowest tests, so growth of the suite shows in CI's log.
test: $(STAMP)
	$(PY) -m pytest -q --durations=25 $(TESTS) $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m bench $(BENCH_ARGS)

compile-report: $(STAMP)
	$(PY) -m fused_block.kernels.aot

clean-venv:
	rm -rf $(VENV)
