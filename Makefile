# The two commands of the README (`make run`, `make test`) and the checks CI runs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml cli/pyproject.toml | sha1sum | cut -c1-12)

.PHONY: run test test-fast e2e lint format bench docs venv services-up services-down clean

$(STAMP): pyproject.toml cli/pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e ./cli -e '.[dev]'
	@rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)

## make run: the whole console on SQLite, a local Redis and the local Docker engine.
run: venv
	@bash .ci/dev-run.sh

## make test-fast: what a developer runs first: PostgreSQL and Redis only (reused when they
## run, else started and stopped), lint, and every test that needs no engine, Procfile process
## or browser (`-m "not engine and not procs and not browser and not e2e"`). Under 2 minutes.
## Narrow it: make test-fast ARGS='tests/test_netguard.py -k redirect'
test-fast:
	@bash .ci/install.sh postgresql redis-server gettext
	@$(MAKE) --no-print-directory venv
	@TIER=fast bash .ci/test.sh $(ARGS)

## make test: installs what is missing, starts PostgreSQL, Redis, two Docker engines, the
## registry and MooseFS, runs everything (what CI runs; the engine tests beside the rest).
test:
	@bash .ci/install.sh
	@$(MAKE) --no-print-directory venv
	@bash .ci/test.sh $(ARGS)

## make e2e: real 2-node PyTorch DDP across the two engines (builds the torch image once).
e2e:
	@bash .ci/install.sh
	@$(MAKE) --no-print-directory venv
	@E2E=1 bash .ci/test.sh -m e2e

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

services-up:
	@bash .ci/services.sh start

services-down:
	@bash .ci/services.sh stop

clean:
	bash .ci/services.sh stop --clean || true
	rm -rf .run staticfiles db.sqlite3

## make docs: the manual (docs/, MkDocs Material) into site/; regenerates docs/packages.md
## and docs/operator/settings.md from the code first (commit them with the change).
docs: venv
	$(VENV)/bin/python docs/gen_packages.py
	$(VENV)/bin/python docs/gen_settings.py
	$(VENV)/bin/mkdocs build --strict --site-dir site

## make bench: the benchmarks, one JSON line per case.
bench: venv
	@bash bench/run.sh
