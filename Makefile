# jaxaot: `make run` and `make test` each create .venv when it is missing, install the project
# into it, then do their job. Nothing else needs to be installed by hand.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.jaxaot-installed
EXTRAS ?= dev,sweep,tpu

.PHONY: run test lint bench clean venv graphviz

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
	@touch $@

venv: $(STAMP)

# Graphviz renders the optimized-HLO graph; without it jaxaot writes the DOT file only.
graphviz:
	@command -v dot >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
	  && (apt-get update -qq && apt-get install -y -qq graphviz >/dev/null) \
	  || echo "note: graphviz not installed; graph rendering is skipped (DOT only)"; }

run: $(STAMP)
	$(BIN)/jaxaot $(ARGS)

test: $(STAMP) graphviz
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check pipeline stages jaxaot_examples tests bench hydra_plugins
	$(BIN)/ruff format --check pipeline stages jaxaot_examples tests bench hydra_plugins
	$(BIN)/mypy pipeline stages hydra_plugins

bench: $(STAMP)
	$(BIN)/python bench/pipeline_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
