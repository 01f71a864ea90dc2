# jaxaot: `make run` and `make test` each create .venv when it is missing, install the project
# into it, then do their job. Nothing else needs to be installed by hand.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
# `make run` installs jaxaot alone; `make test` adds every extra the tests exercise.
RUN_STAMP  := $(VENV)/.jaxaot-run
TEST_STAMP := $(VENV)/.jaxaot-test
EXTRAS ?= dev,testing,sweep,tpu,cuda-aot,profile,models,tracking,s3,gcs

.PHONY: run test test-fast test-server test-plain test-matrix lint bench clean venv graphviz slurm chromium

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(RUN_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	@touch $@

# mypy's analysis of the dependencies (tests/typing_deps.py: the third-party modules jaxaot
# imports) is done once here, into $(VENV)/mypy-deps-cache, where test_lint_and_types starts from;
# a failed build leaves mypy's output in $(VENV)/mypy-deps-cache.failed, which a test reports, and
# the environment unstamped: the next `make venv` or `make test` builds it again.
$(TEST_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
	@rm -rf $(VENV)/mypy-deps-cache $(VENV)/mypy-deps-cache.failed \
	  && $(BIN)/python tests/typing_deps.py > $(VENV)/typing_deps.py
	@echo "mypy: analysing the dependencies once (tests/typing_deps.py) ..."
	@$(BIN)/mypy --config-file pyproject.toml --cache-dir $(VENV)/mypy-deps-cache $(VENV)/typing_deps.py \
	  > $(VENV)/mypy-deps.log 2>&1 || { mv $(VENV)/mypy-deps.log $(VENV)/mypy-deps-cache.failed; \
	  echo "note: mypy's dependency cache was not built ($(VENV)/mypy-deps-cache.failed says why)"; }
	@rm -f $(VENV)/mypy-deps.log
	@touch $(RUN_STAMP)
	@test -e $(VENV)/mypy-deps-cache.failed || touch $@

venv: $(TEST_STAMP)

# Graphviz renders the optimized-HLO graph; without it jaxaot writes the DOT file only and the
# rendering tests are skipped (pytest -ra prints why). Installed only as root with apt-get.
graphviz:
	@if command -v dot >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "installing Graphviz (apt-get install graphviz) for the graph-rendering tests ..."; \
	  (apt-get update -qq && apt-get install -y -qq graphviz >/dev/null) \
	    || echo "note: installing Graphviz failed; the graph-rendering tests will be skipped"; \
	else \
	  echo "note: Graphviz (dot) is not installed and cannot be here (needs root and apt-get):" \
	    "the graph-rendering tests will be skipped; jaxaot writes DOT files only"; \
	fi

# SLURM and munge for tests/test_slurm.py's throw-away cluster (root only); without them those
# tests skip, saying why.
slurm:
	@if { command -v slurmctld || test -x /usr/sbin/slurmctld; } >/dev/null 2>&1 \
	    && { command -v munged || test -x /usr/sbin/munged; } >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge \
	   >/dev/null) || echo "note: apt-get install slurm-wlm munge failed; the SLURM tests are skipped"; \
	else echo "note: slurm-wlm/munge not installed (needs root and apt); the SLURM tests are skipped"; fi

# Chromium renders `jaxaot-report --html` pages in the report tests (headless); without it those
# tests skip, saying why. Installed only as root with apt-get (Debian's package).
chromium:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	    || echo "note: apt-get install chromium failed; the HTML report browser tests are skipped"; \
	else echo "note: chromium not installed (needs root and apt); the HTML report browser tests are skipped"; fi

run: $(RUN_STAMP)
	$(BIN)/jaxaot $(ARGS)

# pytest-xdist workers (the dev extra's pytest-xdist): one a core, at most 4 (each holds JAX,
# a resident server and the runs it starts); TEST_WORKERS=0 runs the tests in pytest's own
# process. The SLURM tests share one worker (one throw-away cluster at a time).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
XDIST := -n $(TEST_WORKERS) --dist loadgroup
# pytest keeps each test module with its asserts rewritten, and Python each module it compiles,
# in __pycache__ (git-ignored): with PYTHONDONTWRITEBYTECODE=1 every pytest worker rewrites all
# ~120 test modules (~7 s of CPU each) and every `jaxaot` process compiles jaxaot's source again
# (~0.4 s), at every run.
unexport PYTHONDONTWRITEBYTECODE

# Every `jaxaot` a test starts goes through one resident `jaxaot server` per worker, except the
# tests of the process itself (tests/conftest.py's plain_process): see test-server, test-plain.
test: $(TEST_STAMP) graphviz slurm chromium
	$(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The fast tier: the tests that start no process, run no pipeline, compose no config and
# compile nothing (tests/conftest.py says how it is read; under a minute).
test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(XDIST) $(PYTEST_ARGS)

# The same suite with every `jaxaot` run going through the server, the plain_process ones too.
test-server: $(TEST_STAMP) graphviz slurm chromium
	JAXAOT_TEST_SERVER=1 $(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The same suite with every `jaxaot` run a plain process (no server).
test-plain: $(TEST_STAMP) graphviz slurm chromium
	JAXAOT_TEST_SERVER=0 $(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The version matrix (noxfile.py): the fast tier and the central pipeline tests on the oldest
# and the newest supported jax, on Python 3.11 and on 3.13, each in a venv of its own under
# .nox/ (the registry's jax and jaxlib wheels; a few minutes a session). nox finds python3.11 and
# python3.13 on PATH; pyenv's are made visible to it. NOX_ARGS picks sessions, e.g.
# NOX_ARGS="-s core -p 3.13" (one Python's); `$(BIN)/nox -l` lists them.
MATRIX_PYENV := $(shell command -v pyenv >/dev/null 2>&1 && pyenv versions --bare 2>/dev/null \
  | grep -E '^3\.1[13]\.[0-9]+$$' | paste -sd: -)

test-matrix: $(TEST_STAMP)
	$(if $(MATRIX_PYENV),PYENV_VERSION=$(MATRIX_PYENV)) $(BIN)/nox $(or $(NOX_ARGS),-s core)

# mypy reads the package as installed: jaxaot = pipeline/ + stages/ + conf/ + jaxaot_examples/
# (pyproject.toml's package-dir), laid out as symlinks in .typecheck/ (mypy does not run the
# editable install's import hook). Its incremental cache, .mypy_cache/, outlives the layout: a
# later `make lint` rechecks only what changed and what depends on it.
TYPECHECK := .typecheck

lint: $(TEST_STAMP)
	$(BIN)/ruff check pipeline stages jaxaot_examples tests bench hydra_plugins
	$(BIN)/ruff format --check pipeline stages jaxaot_examples tests bench hydra_plugins
	@rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/jaxaot
	@for f in pipeline/*; do ln -s "$$PWD/$$f" $(TYPECHECK)/jaxaot/; done
	@ln -s "$$PWD/stages" $(TYPECHECK)/jaxaot/stages
	@ln -s "$$PWD/conf" $(TYPECHECK)/jaxaot/conf
	@ln -s "$$PWD/jaxaot_examples" $(TYPECHECK)/jaxaot/examples
	cd $(TYPECHECK) && ../$(BIN)/mypy --config-file ../pyproject.toml --cache-dir ../.mypy_cache -p jaxaot

bench: $(TEST_STAMP)
	@echo "bench: jaxaot vs a hand-written jit script, whole processes, 7 rounds of axpy and transformer (a few minutes)"
	$(BIN)/python bench/pipeline_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache $(TYPECHECK) .nox
