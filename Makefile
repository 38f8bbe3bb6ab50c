# Two commands do all the set-up on a fresh machine:
#   make run    create .venv when missing, install, run the main job (`quads train` on the built-in default)
#   make test   same set-up, then lint + the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.quads-installed
PYTEST_ARGS ?=

.PHONY: run test lint setup clean

$(STAMP): pyproject.toml scripts/setup_env.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup_env.sh
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/quads train

lint: $(STAMP)
	$(BIN)/ruff check quads tests benchmarks scripts

test: $(STAMP) lint
	$(BIN)/python -m pytest -n 2 -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache
