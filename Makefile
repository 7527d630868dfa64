# The two commands a person needs: `make run` (the daemon with an embedded mesh)
# and `make test` (the whole suite). Each sets up its own virtualenv.
# `make test-fast` is the inner loop: unit tests and conformance, no broker.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Test processes: the suite mostly waits on daemons, so two workers halve its
# time even on two cores; TEST_WORKERS=0 runs it in this process, one test at a
# time. Whole files go to one worker (their module-scoped clusters are shared).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile

.PHONY: run test test-fast lint bench conformance clean

$(STAMP): pyproject.toml $(wildcard plugins/*/pyproject.toml)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]' $(foreach p,$(wildcard plugins/*),-e ./$(p))
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/meshnode run --config $(or $(CONFIG),config/meshnode.toml) $(ARGS)

# pytest with the given arguments, then conformance whatever pytest said (a
# failing test must not hide the conformance result); both outcomes are
# reported on the last line, and the recipe fails if either failed.
define pytest_and_conformance
	@pytest_rc=0; conformance_rc=0; \
	$(BIN)/python -m pytest -q $(XDIST) $(1) || pytest_rc=$$?; \
	$(BIN)/python -m conformance || conformance_rc=$$?; \
	outcome() { if [ "$$1" -eq 0 ]; then echo passed; else echo "FAILED (exit $$1)"; fi; }; \
	echo "$@: pytest $$(outcome $$pytest_rc), conformance $$(outcome $$conformance_rc)"; \
	[ $$pytest_rc -eq 0 ] && [ $$conformance_rc -eq 0 ]
endef

test: $(STAMP)
	$(BIN)/ruff check src tests conformance benchmarks plugins
	$(BIN)/mypy
	$(call pytest_and_conformance,$(PYTEST_ARGS))

# The unit tests that start real daemons (the benchmark smoke runs) are marked
# integration and left to `make test`.
test-fast: $(STAMP)
	$(call pytest_and_conformance,tests/unit -m "not integration" $(PYTEST_ARGS))

lint: $(STAMP)
	$(BIN)/ruff check src tests conformance benchmarks plugins
	$(BIN)/mypy

conformance: $(STAMP)
	$(BIN)/python -m conformance $(ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
