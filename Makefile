# `make demo` and `make test` work on a fresh clone: each creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: setup demo test test-quick lint bench-quick clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,hf]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/pipedsl train --schedule hanayo -P 4 -M 8 --steps 20 -o out/demo

# the whole suite: three parts side by side, one pytest session each (tests/parts.py)
test: setup
	PIPEDSL_REQUIRE_EXTRAS=1 $(BIN)/python tests/parts.py --durations=25

# the everyday tier: the tests not marked slow (about 4 minutes here; `make test` runs all, about 15)
test-quick: setup
	PIPEDSL_REQUIRE_EXTRAS=1 $(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check pipedsl runtime parallel models trainer visualize tests benchmarks examples

# four same-run ratios against benchmarks/baseline.json in under a minute; exit 1 on a REGRESSION line
bench-quick: setup
	$(BIN)/python benchmarks/bench_quick.py

clean:
	rm -rf $(VENV) out
