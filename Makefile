# The few commands a person types. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Compose v2 plugin when present, else Debian's docker-compose
COMPOSE ?= $(shell docker compose version >/dev/null 2>&1 && echo "docker compose" || echo docker-compose)
COMPOSE_FILE := deploy/compose.yaml
N ?= 4

.PHONY: help install image demo test bench soak lint worker up down scale clean

help: ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[http,dev]'
	@touch $@

install: $(STAMP) ## create .venv with the project, Deno and the test tools

image: $(STAMP) ## build studio-code:1 and studio-code-ts:1 (registry if reachable, else offline)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" docker/build.sh all

demo: install image ## run a sample Python node end to end in a fresh sandbox
	STUDIO_ENABLE_CODE_NODES=1 $(VENV)/bin/studio-code run examples/hello.py --state-file examples/state.json
	STUDIO_ENABLE_CODE_NODES=1 $(VENV)/bin/studio-code run examples/hello.ts --state-file examples/state.json

test: install image ## the whole test suite against real Docker, Redis, Deno, SQLite, PostgreSQL
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest $(PYTEST_ARGS)

bench: install image ## benchmarks: executor vs raw floors, side by side in one run
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m bench

soak: install image ## chaos soak: jobs over 2 workers while workers, Redis, the store are killed (SOAK_ARGS=--jobs 1000)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m bench.soak $(SOAK_ARGS)

lint: install ## ruff and mypy
	$(VENV)/bin/ruff check executor worker api_client tests bench
	$(VENV)/bin/mypy executor worker api_client

worker: install ## a Celery worker on this machine (STUDIO_REDIS_URL, STUDIO_DATABASE_URL)
	STUDIO_ENABLE_CODE_NODES=1 $(VENV)/bin/studio-code worker

up: image ## start API, workers, Redis, PostgreSQL, Prometheus with Compose
	$(COMPOSE) -f $(COMPOSE_FILE) up -d --build

down: ## stop the Compose deployment (workers finish or hand back their nodes)
	$(COMPOSE) -f $(COMPOSE_FILE) down

scale: ## run N workers under Compose: make scale N=4
	$(COMPOSE) -f $(COMPOSE_FILE) up -d --no-recreate --scale worker=$(N)

clean: ## remove the venv and local data
	rm -rf $(VENV) data
