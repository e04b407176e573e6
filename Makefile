PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q -e ".[test]"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python benchmarks/transport.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
