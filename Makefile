# Two commands on a fresh Debian/Ubuntu machine: `make demo` and `make test`.
# The venv is made from the system Python: Triton's Python-backend stub links the system
# libpython and runs the sample models with the venv's packages.
PYTHON ?= $(shell test -x /usr/bin/python3 && echo /usr/bin/python3 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# command:package pairs
SYSTEM_TOOLS := redis-server:redis-server wrk:wrk prometheus:prometheus promtool:prometheus h2load:nghttp2-client chromium:chromium curl:curl
# the benchmark also needs nginx, its yardstick (it starts its own on loopback ports)
BENCH_TOOLS := $(SYSTEM_TOOLS) nginx:nginx

.PHONY: demo test check fuzz soak bench docs screenshots lint system-deps clean help

help:
	@echo "make demo   - create .venv, install, start a local Triton + the gateway, drive a canary"
	@echo "make test   - create .venv, install, run the whole test suite in parallel (starts its own Triton/Redis)"
	@echo "make check  - lint, unit, compat and architecture tests: the loop before every commit (< 2 min)"
	@echo "make fuzz   - the property tests (pytest -m property) with FUZZ_EXAMPLES examples each (default 5000)"
	@echo "make soak   - chaos soak: two Tritons, two replicas on Redis, faults in turn (SOAK_SECONDS, default 300)"
	@echo "make bench  - gateway overhead vs direct-to-Triton and vs nginx (HTTP and gRPC), one run"
	@echo "make docs   - build the documentation site from docs/ into site/ (any warning, e.g. a broken link, fails)"
	@echo "make screenshots - every console page at 1440x900 and 390x844 into docs/screenshots/ (the layout test)"
	@echo "make lint   - ruff and mypy --strict"

# constraints.txt holds the versions the suite passed with, so a clean clone's venv is the one
# tested (an unpinned redis 8.2 once typed a call and failed mypy --strict on CI only).
$(STAMP): pyproject.toml constraints.txt
	@test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,triton,dev]'
	@touch $(STAMP)

# Debian packages the tests and the benchmark use, installed only when missing.
system-deps: TOOLS ?= $(SYSTEM_TOOLS)
system-deps:
	@missing=""; for pair in $(TOOLS); do command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:$$missing"; \
		SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends$$missing >/dev/null; \
	fi

demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/gateway demo

# The suite runs in TEST_WORKERS processes (pytest-xdist), each with its own Triton, Redis and
# port range; tests/schedule.py groups and orders the work, longest first. It ends with its wall
# time and slowest tests. An interrupted run (Ctrl-C, SIGTERM) stops every server it started.
# 5, not 4: the suite is mostly waiting on real intervals (4 workers kept 2 cores ~75% busy); measured
# on fresh clones, 4 workers 9:35 of pytest (ci-46), 5 workers 8:23 (ci-47) with every test passing.
TEST_WORKERS ?= 5
PARALLEL := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder
# Run after the parallel suite, on a quiet machine: its attacks bound how long a bystander waits on the
# gateway (1-2 s) while Triton streams tokens to a client that reads none, and beside four other workers those
# bystanders waited on the machine instead (ci-59, ci-60; each passes alone, ~70 s).
ALONE := tests/abuse/test_stalled_readers.py
test: $(STAMP) system-deps
	PATH="$(CURDIR)/$(BIN):$$PATH"; status=0; \
	$(BIN)/python -m pytest $(PARALLEL) --ignore=$(ALONE) || status=$$?; \
	$(BIN)/python -m pytest -p no:xdist $(ALONE) || status=$$?; \
	exit $$status

# What to run before each commit: ruff and mypy --strict (tests/unit/test_static_checks.py), the
# unit and architecture tests, and the compatibility tests against one real Triton per worker.
check: $(STAMP) system-deps
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -n 3 --dist loadgroup --no-loadscope-reorder \
		--durations=5 tests/unit tests/compat

# The same properties as in `make test`, for longer; the worst value each invariant reached is
# printed at the end ("worst values of the abuse invariants", tests/abuse/worst.py).
FUZZ_EXAMPLES ?= 5000
fuzz: $(STAMP) system-deps
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -m property -o timeout=0 \
		-p no:cacheprovider tests

# The chaos soak (bench/soak.py): not part of `make test`. Two Tritons, two replicas on one Redis
# (one with --workers 2), ~100 req/s of clients that never retry, a healthy and a failing rollout,
# and in turn a Triton SIGKILLed, the other SIGSTOPped, the lease holder killed, Redis restarted, a
# worker killed. Exit 1 on any failed request not in flight on a killed process, a rollout decided
# wrong, or replicas disagreeing with the store.
SOAK_SECONDS ?= 300
soak: $(STAMP) system-deps
	SOAK_SECONDS=$(SOAK_SECONDS) PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python bench/soak.py

bench: $(STAMP)
	@$(MAKE) --no-print-directory system-deps TOOLS='$(BENCH_TOOLS)'
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python bench/overhead.py

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

# The console's pages as docs/console.md shows them: the module that checks their layout at both
# widths, keeping its whole-page screenshots (a real gateway, Triton and Debian's chromium).
screenshots: $(STAMP) system-deps
	CONSOLE_SCREENSHOTS=docs/screenshots PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -p no:cacheprovider \
		tests/console/test_operator_view.py

lint: $(STAMP)
	$(BIN)/ruff check gateway tests bench
	$(BIN)/mypy gateway tests bench

clean:
	rm -rf $(VENV) .pytest_cache build site *.egg-info
