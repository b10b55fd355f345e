# The two commands of the README: `make demo` and `make test`.
# Each sets everything up on a fresh machine: a virtualenv in .venv with the
# package installed from this tree (not editable: the twistd plugin must be
# found from the installed package, as users will have it).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint layers docs-check bench-smoke demo-check docs install install-demo clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/python -m pip install --quiet ".[test]"

# The demo needs the package and the openai client only, not the test toolchain.
install-demo: $(BIN)/python
	$(BIN)/python -m pip install --quiet ".[demo]"

demo: install-demo
	$(BIN)/nixlproxy-demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The tests by layer (pure, in memory, loopback, real processes), then the
# docs build, a benchmark smoke run and the demo, each a step of its own.
test: lint layers docs-check bench-smoke demo-check

layers: install
	$(BIN)/python -m pytest tests/pure tests/memory tests/loopback tests/process

docs-check: install
	$(BIN)/python -m pytest tests/smoke/test_docs.py

bench-smoke: install
	$(BIN)/python -m pytest tests/smoke/test_bench.py

demo-check: install
	$(BIN)/python -m pytest tests/smoke/test_demo.py

docs: install
	$(BIN)/python -m sphinx -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache .hypothesis
