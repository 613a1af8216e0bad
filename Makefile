# `make demo` sets up .venv and runs the main job; `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast bench clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_lm.py

test: $(STAMP)
	$(PY) -m pytest tests -q

test-fast: $(STAMP)
	$(PY) -m pytest tests -q -m "not inductor"

bench: $(STAMP)
	$(VENV)/bin/kiln bench

clean:
	rm -rf $(VENV) build *.egg-info
