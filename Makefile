# The few commands a person types. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The exact version of every package the venv and the app image install (`make lock` makes
# it from pyproject.toml's ranges; docs/operations.md, "Upgrading dependencies").
LOCK := requirements.lock
# Compose: deploy/compose.sh picks the plugin or docker-compose, the network variant and
# the env file. PROJECT names the deployment (a test uses its own).
PROJECT ?= studio-code
COMPOSE := COMPOSE_PROJECT_NAME=$(PROJECT) deploy/compose.sh
N ?= 4
WORKERS ?= 1

.PHONY: help host install lock image demo test test-fast bench soak lint worker up down scale clean

help: ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

host: ## install/start what this machine lacks (Docker engine, debootstrap, ...): scripts/host-setup.sh
	@scripts/host-setup.sh

$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c $(LOCK) --upgrade pip
	$(PY) -m pip install -q -c $(LOCK) -e '.[http,dev]'
	@# as a regular (non-editable) pip install does: the CLI then starts without compiling
	@# the project's modules (a later edit is recompiled in memory, never run stale)
	$(PY) -m compileall -q executor worker api_client >/dev/null
	@touch $@

install: $(STAMP) ## create .venv with the project, Deno and the test tools, at the versions of requirements.lock

# Resolved for every Python the project supports (3.11 up, the app image's 3.12 and Debian's
# 3.13 included) and every platform (--universal), with two names beside the project's:
# pip (what the venv upgrades to) and hatchling (the app image's build backend). Pins that
# still fit are kept; LOCK_ARGS=--upgrade takes the newest in range, or
# LOCK_ARGS='--upgrade-package celery --upgrade-package kombu' only those.
lock: ## re-resolve requirements.lock from pyproject.toml (LOCK_ARGS=--upgrade for the newest)
	@test -x $(VENV)/bin/uv || { $(PYTHON) -m venv $(VENV) && $(PY) -m pip install -q -c $(LOCK) uv; }
	printf 'pip\nhatchling\n' | $(VENV)/bin/uv pip compile --quiet --universal \
	  --python-version 3.11 --extra http --extra dev --custom-compile-command 'make lock' \
	  $(LOCK_ARGS) -o $(LOCK) pyproject.toml -

# The repository's package lists (docker/studio-code/requirements.txt, docker/studio-code-ts/
# deps.ts); IMAGE_ARGS='--python-packages "requests==2.32.*,pandas" --wheels DIR ...' builds
# others (docs/operations.md, "Adding a package").
image: $(STAMP) ## build studio-code:1 and studio-code-ts:1 (registry if reachable, else offline)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/studio-code image build $(IMAGE_ARGS)

demo: host install image ## run a sample Python node end to end in a fresh sandbox
	STUDIO_ENABLE_CODE_NODES=1 $(VENV)/bin/studio-code run examples/hello.py --state-file examples/state.json
	STUDIO_ENABLE_CODE_NODES=1 $(VENV)/bin/studio-code run examples/hello.ts --state-file examples/state.json

# The suite waits on containers and services far more than it computes: its modules run on
# TEST_PROCS processes at once (pytest-xdist; each module on one process, a group of modules
# that must not overlap on one process in turn: tests/conftest.py). TEST_PROCS=0: one process.
TEST_PROCS ?= 3
test: host install image ## the whole test suite against real Docker, Redis, Deno, SQLite, PostgreSQL
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest $(if $(filter-out 0,$(TEST_PROCS)),-n $(TEST_PROCS) --dist loadgroup --no-loadscope-reorder) $(PYTEST_ARGS)

# The markers are derived from the fixtures a test uses (tests/conftest.py): what is left
# needs no Docker engine, redis-server, PostgreSQL, Deno nor Compose, only `make install`.
FAST := not docker and not redis and not postgres and not deno and not compose and not slow
test-fast: install ## the one-minute tier: the tests that need no Docker, Redis, PostgreSQL nor Deno
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -m "$(FAST)" -q -p no:cacheprovider $(PYTEST_ARGS)

bench: install image ## benchmarks: executor vs raw floors, side by side in one run
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m bench

soak: install image ## chaos soak: jobs over 2 workers while workers, Redis, the store are killed (SOAK_ARGS="--jobs 1000", --faults ... engine sentinel, --retries, --long)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m bench.soak $(SOAK_ARGS)

lint: install ## ruff (lint and format) and mypy
	$(VENV)/bin/ruff check executor worker api_client tests bench testkit
	$(VENV)/bin/ruff format --check executor worker api_client tests bench testkit
	$(VENV)/bin/mypy executor worker api_client testkit

worker: install ## a Celery worker on this machine (STUDIO_REDIS_URL, STUDIO_DATABASE_URL)
	STUDIO_ENABLE_CODE_NODES=1 $(VENV)/bin/studio-code worker

up: host ## start API, WORKERS workers, Redis, PostgreSQL, Prometheus with Compose (images built if no registry)
	@docker image inspect $${STUDIO_CODE_IMAGE:-studio-code:1} \
	  $${STUDIO_CODE_TS_IMAGE:-studio-code-ts:1} >/dev/null 2>&1 || $(MAKE) image
	$(COMPOSE) up $(WORKERS)

down: ## stop the Compose deployment (workers finish their nodes); PURGE=1 also drops volumes and secrets
	$(COMPOSE) down $(if $(filter 1,$(PURGE)),--purge)

scale: ## run N workers under Compose: make scale N=4
	$(COMPOSE) scale $(N)

clean: ## remove the venv and local data
	rm -rf $(VENV) data
