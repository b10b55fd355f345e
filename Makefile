# The two commands of the README: `make demo` and `make test`.
# Each sets everything up on a fresh machine: a virtualenv in .venv with the
# package installed from this tree (not editable: the twistd plugin must be
# found from the installed package, as users will have it).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint docs install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/python -m pip install --quiet ".[test]"

demo: install
	$(BIN)/nixlproxy-demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest

docs: install
	$(BIN)/python -m sphinx -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache .hypothesis
