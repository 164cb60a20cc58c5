# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: demo test test-slow test-browser serve lint format data clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/captioning quickstart --out runs/quickstart

# The default suite on every core (pytest-xdist; each worker's torch runs one thread).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -rs -m slow

# The browser test drives Debian's chromium through chromedriver (no browser downloads).
test-browser: $(STAMP)
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	fi
	$(BIN)/python -m pytest -q -m browser

# The web demo on the quickstart's model (run `make demo` first).
serve: $(STAMP)
	$(BIN)/captioning serve --checkpoint runs/quickstart/best.pt

lint: $(STAMP)
	$(BIN)/ruff check captioning tests tools benchmarks lab
	$(BIN)/ruff format --check captioning tests tools benchmarks lab

format: $(STAMP)
	$(BIN)/ruff format captioning tests tools benchmarks lab
	$(BIN)/ruff check --fix captioning tests tools benchmarks lab

data: $(STAMP)
	$(BIN)/captioning shapes --out data/shapes --train 8000 --val 500 --test 500 --seed 0

clean:
	rm -rf runs .pytest_cache
