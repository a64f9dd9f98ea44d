# The two commands of the README's contract: `make setup` (fresh machine -> ready), `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test test-fast lint format mutation
setup:
	bash scripts/setup.sh

test:
	$(PY) -m pytest -q

test-fast:
	$(PY) -m pytest -q -m "not slow"

lint:
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format:
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

# Mutation score of the claims' modules (docs/testing.md#mutation-score): not in `make test` (an hour or more on 2 cores).
# MUTATE selects mutants by name, e.g. make mutation MUTATE="dspo.runs.trust*"; DSPO_MUTATION=1 runs a tenth of the property
# tests' examples per mutant. OMP_NUM_THREADS=1: mutmut forks its test processes from one that ran torch.
MUTATE ?=
mutation:
	rm -rf mutants && DSPO_MUTATION=1 OMP_NUM_THREADS=1 $(VENV)/bin/mutmut run --max-children 2 $(MUTATE); \
	$(VENV)/bin/mutmut results
