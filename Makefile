PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test lint fuzz bench serve clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	@touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check ninfer tests kernels
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check ninfer tests kernels

# Long fuzzing, not CI: MINUTES=N in all (default 10), half each to the Hypothesis state
# machine and the deterministic simulation, both with random seeds.
MINUTES ?= 10
fuzz: $(STAMP)
	$(BIN)/ninfer fuzz stateful --minutes $$($(BIN)/python -c 'print($(MINUTES) / 2)')
	$(BIN)/ninfer fuzz sim --minutes $$($(BIN)/python -c 'print($(MINUTES) / 2)')

bench: $(STAMP)
	$(BIN)/ninfer bench lifecycle

# The OpenAI-compatible server on the embedded default model: ARGS="--port 9000 ..." adds options.
ARGS ?=
serve: $(STAMP)
	$(BIN)/ninfer serve $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
