# Two entry points for a fresh machine: `make demo` and `make test`. Both build .venv on first use.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch lies on this machine's disk; any other torch spec would download gigabytes.
WHEELS := $(wildcard /opt/wheels)
# torch's exact build (constraints-torch.txt: the CPU wheel above), used where that wheel is on disk. A host with a
# torch of its own (a CUDA build on a GPU host) keeps it: `make test TORCH_CONSTRAINTS= VENV_FLAGS=--system-site-packages
# PYTHON=python3.12` builds the venv on the system's site-packages, pins everything but torch, and pip finds
# `torch>=2.4` already satisfied. Without the wheel folder torch is left unpinned by default.
TORCH_CONSTRAINTS ?= $(if $(WHEELS),constraints-torch.txt)
VENV_FLAGS ?=
PIP_FLAGS := -q -c constraints.txt $(if $(TORCH_CONSTRAINTS),-c $(TORCH_CONSTRAINTS)) $(if $(WHEELS),--find-links $(WHEELS))

.PHONY: demo test bench lint chromium prometheus systemd slurm migration clean gpu-check

$(STAMP): pyproject.toml constraints.txt $(TORCH_CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(BIN)/python -m pip install $(PIP_FLAGS) -e '.[all,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fleetlens demo

# The import contracts run first, as lint-imports prints them; pytest then skips its own run of them
# (tests/test_layers.py::test_import_contracts, there so that a bare `pytest` checks them too).
# PostgreSQL tests run against the local server when it answers and FLEETLENS_TEST_PG_URL is unset; when it does
# not answer they are skipped, and the run says so first (with CI=true, tests/conftest.py fails them instead).
# The suite runs on PYTEST_WORKERS processes (pytest-xdist); tests/conftest.py keeps the tests that start a whole
# deployment (the demo, the Celery cluster) one at a time, each group on one worker (SERIAL_GROUPS).
PYTEST_WORKERS ?= 2
PG_TEST_URL := postgresql+psycopg://postgres@127.0.0.1:5432/test
PG_PROBE := import psycopg; psycopg.connect('postgresql://postgres@127.0.0.1:5432/test', connect_timeout=3).close()
test: $(STAMP) chromium prometheus systemd slurm
	$(BIN)/lint-imports --no-cache
	@if [ -z "$$FLEETLENS_TEST_PG_URL" ]; then \
	  if $(BIN)/python -c "$(PG_PROBE)" 2>/dev/null; then \
	    export FLEETLENS_TEST_PG_URL='$(PG_TEST_URL)'; \
	    echo "PostgreSQL answers at 127.0.0.1:5432: the PostgreSQL tests use $(PG_TEST_URL)"; \
	  else \
	    echo "PostgreSQL does not answer at 127.0.0.1:5432 and FLEETLENS_TEST_PG_URL is unset:" \
	         "PostgreSQL tests will be skipped$${CI:+ (CI=$$CI: they fail instead)}"; \
	  fi; \
	fi; \
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --deselect tests/test_layers.py::test_import_contracts \
	  $(PYTEST_ARGS)

bench: $(STAMP)
	@set -e; for f in benchmarks/*.py; do echo "# $$f" >&2; $(BIN)/python $$f; done

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

# Browser tests drive Debian's chromium (never a browser downloaded by Playwright).
chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

# The Prometheus tests run Debian's prometheus and promtool directly (no service is started).
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || \
		{ apt-get update -qq && apt-get install -y -qq prometheus >/dev/null; }

# On a machine with one NVIDIA GPU (and its driver; MPS tools for the MPS part): the `gpu` tests, the nvml source idle
# and busy, the two-job lane test under PACK and a two-lane MPS test (70 %/30 %), within GPU_CHECK_TIMEOUT_S; one
# JSON summary on stdout (and in $(GPU_CHECK_OUT)). No network beyond what the host already has. Keep the host's
# CUDA torch with TORCH_CONSTRAINTS= (see above). Exit status 0 only when every part that could run passed.
GPU_CHECK_TIMEOUT_S ?= 450
GPU_CHECK_OUT ?= gpu-check.json
gpu-check: $(STAMP)
	$(BIN)/python -m tests.gpu.check --timeout $(GPU_CHECK_TIMEOUT_S) --out $(GPU_CHECK_OUT)

# deploy/systemd's units are checked by systemd-analyze verify (Debian's systemd package; no systemd needs to run).
systemd:
	@command -v systemd-analyze >/dev/null || { apt-get update -qq && apt-get install -y -qq systemd >/dev/null; }

# The Slurm tests (marked slurm) start a real one-node Slurm 22.05 with ../shared/slurm/local-cluster.sh: Debian's
# daemons and client, and munge for their authentication (the script never uses /etc/slurm or systemd).
slurm:
	@command -v slurmctld >/dev/null && command -v sbatch >/dev/null && command -v munged >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		  slurm-wlm slurm-client munge >/dev/null; }

# Write the next migration from the models' difference to the migrations so far: make migration MSG="what changed".
migration: $(STAMP)
	$(BIN)/python alembic/new_revision.py $(MSG)

clean:
	rm -rf $(VENV)
