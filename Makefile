# Two commands set up everything on a fresh machine with Python 3.11+ and pip:
#   make demo   -- create .venv, install, run the main job end to end
#   make test   -- create .venv, install, lint (ruff, mypy), run the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup lint test demo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check predictor router_client proxy models migrations tests
	$(BIN)/mypy router_client predictor proxy models

# Two workers (pytest-xdist): the suite is mostly real processes waiting on each other; on the
# 2-core CI machine its 600-odd tests take 9-12 minutes (one process, PYTEST_WORKERS=0, took
# about 1.6 times as long when last measured). The 15 slowest are listed at the end.
PYTEST_WORKERS ?= 2

test: lint
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --durations=15

demo: $(STAMP)
	$(BIN)/balanceroute demo

bench: $(STAMP)
	$(BIN)/balanceroute bench router --workers 8 --rmax 4 --pool 256
	$(BIN)/balanceroute bench router --workers 64 --rmax 4 --pool 1024

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
