# The two commands a person needs: `make run` (the daemon with an embedded mesh)
# and `make test` (the whole suite). Each sets up its own virtualenv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench conformance clean

$(STAMP): pyproject.toml $(wildcard plugins/*/pyproject.toml)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]' $(foreach p,$(wildcard plugins/*),-e ./$(p))
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/meshnode run --config $(or $(CONFIG),config/meshnode.toml) $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check src tests conformance benchmarks plugins
	$(BIN)/mypy
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
	$(BIN)/python -m conformance

lint: $(STAMP)
	$(BIN)/ruff check src tests conformance benchmarks plugins
	$(BIN)/mypy

conformance: $(STAMP)
	$(BIN)/python -m conformance $(ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
