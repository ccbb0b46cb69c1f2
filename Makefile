# runlog developer entry points. Everything runs from the project's own virtualenv (.venv).
#   make venv   create .venv (python3.11+ from PATH) and install runlog with dev extras
#   make stack  start the local Kafka (KRaft, one node) + Redis stack and create topics
#   make test   stack, then the suite (pytest -q) in two lanes side by side: tools/test_lanes.sh
#   make faults fault tests on their own 3-node cluster + Redis (minutes; tests/faults)
#   make explore  the fault explorer: SEED=7 STEPS=40 [KEEP=0,3,9] one history; no SEED: seeds until one fails
#   make soak   every fault at the reliability goals' counts (~2 h; SCALE=0.01 or KILLS=.. RACES=.. etc.)
#   make soak-integrations  the integrations' conformance harness with 500 kills each (CONFORMANCE_KILLS=..)
#   make lint   ruff check, ruff format --check, mypy (strict)
#   make docs   the documentation site into site/ (mkdocs build --strict: broken links fail)
#   make reference  rewrite the generated reference pages (docs/reference/cli.md, settings.md)
#   make demo   stack + topics, then the fleet demo: 3 workers, kill -9 and SIGSTOP (DEMO_SEED=7 DEMO_KILLS=5 DEMO_PAUSES=2)
#   make down   stop the local stack (and the secure one, if the tests left it running)
#   make bench  stack, then every benchmark and bench scale into bench-results/ (BENCH_ARGS=--quick)
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV ?= .venv
PY := $(VENV)/bin/python
RUNLOG := $(VENV)/bin/runlog
STAMP := $(VENV)/.installed
# First python3.11+ found on PATH (override: make venv PYTHON=/path/to/python3.12).
PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3; do \
	if command -v $$p >/dev/null 2>&1 && \
	   $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then \
	   echo $$p; break; fi; done)
PACKAGES := runlog producers consumers schemas projections
LINT_PATHS := $(PACKAGES) tools tests docs/hooks.py docs/gen_reference.py
PYTEST_ARGS ?=
# The demo (README "The demo"): three `runlog worker` processes SIGKILLed at random, no
# supervisor (tools/demo, a clone's). Override DEMO_CMD to run something else on the same stack.
DEMO_SEED ?= 7
DEMO_KILLS ?= 5
DEMO_PAUSES ?= 2
DEMO_ARGS ?=
DEMO_CMD ?= $(RUNLOG) demo --seed $(DEMO_SEED) --kills $(DEMO_KILLS) --pauses $(DEMO_PAUSES) $(DEMO_ARGS)

.PHONY: help venv stack topics test faults explore soak soak-integrations lint docs reference demo down status bench

help:
	@sed -n '2,14p' Makefile | sed 's/^# \{0,1\}//'

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "make venv: no python3.11+ found on PATH" >&2; exit 1; }
	@echo "make venv: using $$(command -v $(PYTHON)) ($$($(PYTHON) -V))"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# topics go to the stack just started (its ports may be overridden by RUNLOG_STACK_*).
# With a schema registry running (runlog stack up --registry), writers use it: register
# the released schemas too, or their first append is refused.
stack: venv
	$(RUNLOG) stack up
	eval "$$($(RUNLOG) stack env)" && $(RUNLOG) topics create && \
	  if [ -n "$$RUNLOG_SCHEMA_REGISTRY_URL" ]; then $(RUNLOG) schemas register >/dev/null; fi

topics: venv
	$(RUNLOG) topics create

test: stack
	tools/test_lanes.sh $(PY) $(PYTEST_ARGS)

# The fault suite starts (and stops) its own cluster: `runlog stack up --nodes 3`.
faults: venv
	$(PY) -m pytest -q tests/faults $(PYTEST_ARGS)

# The explorer and the soak run on the 3-node cluster (RUNLOG_CLUSTER_* ports), starting it
# if it is not running and stopping it afterwards unless EXPLORER_KEEP_CLUSTER=1.
SEED ?=
STEPS ?= 40
KEEP ?=
explore: venv
	$(PY) tests/explorer/explorer.py $(if $(SEED),run --seed $(SEED) $(if $(KEEP),--keep $(KEEP)),forever) --steps $(STEPS)

SCALE ?= 1
SOAK_ARGS ?=
soak: venv
	$(PY) tests/explorer/soak.py --scale $(SCALE) $(if $(KILLS),--kills $(KILLS)) \
		$(if $(RACES),--races $(RACES)) $(if $(LEADER_KILLS),--leader-kills $(LEADER_KILLS)) \
		$(if $(REDIS_RESTARTS),--redis-restarts $(REDIS_RESTARTS)) \
		$(if $(HOSTILE),--hostile $(HOSTILE)) $(if $(PARTITIONS),--partitions $(PARTITIONS)) \
		$(if $(LOSSY),--lossy $(LOSSY)) $(if $(SKEWS),--skews $(SKEWS)) $(SOAK_ARGS)

# The conformance harness of the agent-framework integrations (tests/integrations/conformance)
# on the local stack, with the soak's kill count instead of the 50 per integration of make test.
CONFORMANCE_KILLS ?= 500
soak-integrations: stack
	RUNLOG_CONFORMANCE_KILLS=$(CONFORMANCE_KILLS) $(PY) -m pytest -q -s \
		tests/integrations/conformance $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy

# The site documents this tree (docs/hooks.py puts it first on sys.path); no stack needed.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d site

# The CLI and settings pages are generated from the code and checked in (readable on GitHub);
# tests/test_docs.py fails when they are stale.
reference: venv
	$(PY) docs/gen_reference.py

# The demo talks to the stack just started (its ports may be overridden by RUNLOG_STACK_*).
demo: stack
	eval "$$($(RUNLOG) stack env)" && $(DEMO_CMD)

bench: stack
	$(PY) -m pip install -q -e '.[bench,peers]'
	$(RUNLOG) bench $(BENCH_ARGS)
	$(RUNLOG) bench scale $(BENCH_ARGS)

down:
	@if test -x $(RUNLOG); then $(RUNLOG) stack down; rc=$$?; $(RUNLOG) stack down --secure >/dev/null; exit $$rc; \
	else echo "make down: no $(VENV); nothing to stop"; fi

status: venv
	$(RUNLOG) stack status
