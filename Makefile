# Two commands: `make run` (main job) and `make test` (the suite CI runs).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(BIN)/.installed

run: install
	$(BIN)/jaxformer train configs/reverse.py

test: install
	$(BIN)/python -m pytest -n 2 --dist loadfile

test-all: install
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "slow or not slow"

.PHONY: install run test test-all
