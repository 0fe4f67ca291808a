# The two set-up commands of the README. Each one creates the virtualenv and installs what it
# needs, so a fresh machine with only python3 is enough.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: up test lint install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/syshax up $(ARGS)

test: $(STAMP)
	$(PY) scripts/dev/run_tests.py $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) var .pytest_cache
