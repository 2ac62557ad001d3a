# The two commands of the README: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

NODE_EXAMPLES := docs/examples/node
NODE_STAMP := $(NODE_EXAMPLES)/node_modules/.installed

.PHONY: demo test test-cluster test-repeat lint typecheck pytest protos check-protos clean bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/quayutec demo

test: $(STAMP) lint typecheck check-protos pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/buf lint

typecheck: $(STAMP)
	$(BIN)/mypy

check-protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py --check

# The API guide's Node example (docs/api.md), run by tests/test_docs.py: its packages from the lock file.
$(NODE_STAMP): $(NODE_EXAMPLES)/package-lock.json
	cd $(NODE_EXAMPLES) && npm ci --no-audit --no-fund
	touch $(NODE_STAMP)

pytest: $(STAMP) $(NODE_STAMP)
	$(BIN)/pytest

# The flake check: the console, delivery and held-action tests N times (default 20) under one
# busy-loop process per core; prints the pass count. `make test-repeat N=5`.
N ?= 20
test-repeat: $(STAMP)
	$(BIN)/python scripts/repeat_tests.py --rounds $(N)

# The multi-host bed's tests (tests/cluster): faults across a network of namespaces, as root, in
# namespaces of their own (`unshare`); about 8 minutes. `.ci/run` runs them after `make test`.
test-cluster: $(STAMP)
	$(BIN)/python -m scripts.cluster test

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	$(BIN)/python bench/claims.py
	$(BIN)/python bench/runs.py
	$(BIN)/python bench/wakes.py
	$(BIN)/python bench/parked.py
	$(BIN)/python bench/watch.py
	$(BIN)/python bench/inflight.py
	$(BIN)/python bench/tables.py

# Stops the embedded PostgreSQL of .quayutec first: deleting its folder under a live server leaves
# a server that no command can reach.
clean:
	if [ -x $(BIN)/quayutec ]; then QUAYUTEC_DATA_DIR=.quayutec $(BIN)/quayutec db stop; fi
	rm -rf $(VENV) .quayutec .pytest_cache .mypy_cache .ruff_cache $(NODE_EXAMPLES)/node_modules
