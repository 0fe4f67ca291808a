# The set-up and test commands of the README and CONTRIBUTING.md. Each one creates the
# virtualenv and installs what it needs, so a fresh machine with only python3 is enough.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: up check test lint install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/syshax up $(ARGS)

# The inner loop, about a minute: lint, import contracts and the fast tier in parallel.
check: $(STAMP)
	$(PY) scripts/dev/run_tests.py --check $(ARGS)

# Everything, as CI runs it (.ci/run).
test: $(STAMP)
	$(PY) scripts/dev/run_tests.py $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) var .pytest_cache
