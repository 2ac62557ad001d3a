# The two commands of the README: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PINS := $(shell cat pyproject.toml clients/python/pyproject.toml | sha1sum | cut -c1-12)
# What is installed in .venv, per version of the pins: the dev extra and the Python client SDK
# (tests, lint, types, the browser and API-example tools), or the runtime dependencies alone, all
# the demo needs.
STAMP := $(VENV)/.installed-$(PINS)
RUN_STAMP := $(VENV)/.installed-run-$(PINS)

NODE_EXAMPLES := docs/examples/node
NODE_STAMP := $(NODE_EXAMPLES)/node_modules/.installed
# The TypeScript client SDK: its packages from its lock file (tests/clients runs `npm test` against the stack).
TS_CLIENT := clients/typescript
TS_STAMP := $(TS_CLIENT)/node_modules/.installed
# The OpenID provider the console's sign-in tests run on loopback (tests/oidc/provider.mjs).
OIDC_PROVIDER := tests/oidc
OIDC_STAMP := $(OIDC_PROVIDER)/node_modules/.installed
# The Python client SDK and what it installs, downloaded once, so that tests/clients installs it into a
# fresh venv without reaching any index.
WHEELHOUSE := $(VENV)/wheelhouse
# Jaeger v2's binary, built from tools/jaeger (the jaeger-bin target below).
GO ?= go
JAEGER_PINS := $(shell cat tools/jaeger/go.mod tools/jaeger/go.sum | sha1sum | cut -c1-12)
JAEGER_BIN := build/jaeger-$(JAEGER_PINS)/jaeger
JAEGER_CONFIG := deploy/k8s/base/jaeger-config.yaml

.PHONY: help demo test test-cluster jaeger-bin jaeger jaeger-stop ha-packages test-repeat lint typecheck pytest protos check-protos secrets k8s-dev-mtls clean bench

# `make` alone, or `make help`: each target a person runs, with its one line (the `## ` after the target).
help:  ## list the targets with one line each
	@awk -F':.*## ' '/^[a-z][a-z0-9-]*:.*## / { printf "  make %-14s %s\n", $$1, $$2 }' $(MAKEFILE_LIST)

# The venv itself, once; pip's cache (~/.cache/pip) serves what was downloaded before.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3

$(STAMP): pyproject.toml clients/python/pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]'
	# The Python client SDK (clients/python), for its tests, the docs' examples and the bench.
	$(BIN)/pip install --quiet -e clients/python
	touch $(STAMP)

# The demo's first run installs the runtime dependencies only, without compiling every module up
# front (Python compiles what runs, once); a venv with the dev extra has them already.
$(RUN_STAMP): pyproject.toml | $(BIN)/python
	if [ ! -e $(STAMP) ]; then $(BIN)/pip install --quiet --no-compile -e .; fi
	touch $(RUN_STAMP)

demo: $(RUN_STAMP)  ## the two-company demo on an embedded PostgreSQL; the stack stays up until Ctrl-C (CI=true: it stops)
	$(BIN)/quayutec demo

test: $(STAMP) lint typecheck check-protos secrets pytest  ## everything: ruff, buf lint, mypy, proto check, secret scan, pytest

lint: $(STAMP)  ## ruff check, ruff format --check, buf lint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/buf lint

typecheck: $(STAMP)  ## mypy --strict
	$(BIN)/mypy

check-protos: $(STAMP)  ## fails when the generated code in quayutec/v1 is stale
	$(BIN)/python scripts/gen_protos.py --check

# No private key or token in any file git would commit (detect-secrets; see the script).
secrets: $(STAMP)  ## no private key or token in any file git would commit
	$(BIN)/python scripts/scan_secrets.py

# The dev overlay's mutual-TLS files, made before `kubectl apply -k deploy/k8s/overlays/dev`.
k8s-dev-mtls: $(STAMP)  ## the Kubernetes dev overlay's mutual-TLS files
	$(BIN)/python scripts/dev_k8s_mtls.py

# The API guide's Node example (docs/api.md), run by tests/test_docs.py: its packages from the lock file.
$(NODE_STAMP): $(NODE_EXAMPLES)/package-lock.json
	cd $(NODE_EXAMPLES) && npm ci --no-audit --no-fund
	touch $(NODE_STAMP)

# `npm ci` fetches only the lock file's tarballs; `npm cache add` also keeps the client's dependencies'
# full metadata, which tests/clients/test_typescript.py's offline `npm install` of the packed client
# needs (without it that install fails ENOTCACHED on a machine whose npm cache is new).
$(TS_STAMP): $(TS_CLIENT)/package-lock.json
	cd $(TS_CLIENT) && npm ci --no-audit --no-fund
	cd $(TS_CLIENT) && npm cache add $$(node -p "Object.entries(require('./package.json').dependencies).map(([n, v]) => n + '@' + v).join(' ')")
	touch $(TS_STAMP)

$(OIDC_STAMP): $(OIDC_PROVIDER)/package-lock.json
	cd $(OIDC_PROVIDER) && npm ci --no-audit --no-fund
	touch $(OIDC_STAMP)

$(WHEELHOUSE)/.complete: $(STAMP) clients/python/pyproject.toml
	rm -rf $(WHEELHOUSE)
	$(BIN)/pip download --quiet -d $(WHEELHOUSE) setuptools==80.9.0 ./clients/python
	touch $@

# The trace tests (tests/jaeger) run a real Jaeger v2: built before pytest starts, so its first build
# is not counted against a test's timeout.
pytest: $(STAMP) $(NODE_STAMP) $(TS_STAMP) $(OIDC_STAMP) $(WHEELHOUSE)/.complete $(JAEGER_BIN)  ## the tests alone (npm ci for the Node parts, Jaeger built first)
	QUAYUTEC_TEST_JAEGER_BIN=$(CURDIR)/$(JAEGER_BIN) $(BIN)/pytest

# The flake check: the console, delivery and held-action tests N times (default 20) under one
# busy-loop process per core; prints the pass count. `make test-repeat N=5`.
N ?= 20
test-repeat: $(STAMP)  ## the flake check: load-sensitive tests N times (default 20) under a CPU hog
	$(BIN)/python scripts/repeat_tests.py --rounds $(N)

# The multi-host bed's tests (tests/cluster): faults across a network of namespaces, as root, in
# namespaces of their own (`unshare`); about 8 minutes, then the database failovers on the HA bed
# (tests/cluster/test_failover.py), about 2 more. `.ci/run` runs them after `make test`.
test-cluster: $(STAMP) ha-packages  ## as root: the multi-host bed's faults and database failovers (~10 minutes)
	$(BIN)/python -m scripts.cluster test -s

# The HA bed's database hosts run Debian's PostgreSQL 15, Patroni and etcd (tests/cluster/ha.py), installed
# here when missing. Tested with bookworm's postgresql-15 15.18, patroni 3.0.2-1, etcd-server 3.4.23;
# the bed uses none of the services these packages may set up, only their programs.
HA_PACKAGES := postgresql-15 patroni python3-etcd etcd-server
ha-packages:  ## installs the HA bed's Debian packages when missing
	if [ ! -x /usr/lib/postgresql/15/bin/postgres ] || [ ! -x /usr/bin/patroni ] || [ ! -x /usr/bin/etcd ]; then \
	  sudo=""; if [ "$$(id -u)" != 0 ]; then sudo="sudo"; fi; \
	  $$sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q $(HA_PACKAGES); \
	fi

# Jaeger v2, built here from its Go module (tools/jaeger pins it in go.mod/go.sum): into an ignored
# folder, once per version of the pins, then reused. Nothing comes from anywhere but the Go module
# proxy; the Go module and build caches (~/go/pkg/mod, ~/.cache/go-build) make a rebuild in a new
# clone on the same machine quick (README: the cold and warm build times). A plain build embeds no
# UI: the query API (/api/v3) answers, and the UI's page is a placeholder.

$(JAEGER_BIN): tools/jaeger/go.mod tools/jaeger/go.sum
	cd tools/jaeger && GOTOOLCHAIN=local GOFLAGS=-mod=readonly $(GO) build -trimpath -o $(CURDIR)/$@.tmp github.com/jaegertracing/jaeger/cmd/jaeger
	mv $@.tmp $@

jaeger-bin: $(JAEGER_BIN)  ## builds Jaeger v2 from tools/jaeger once, prints its path
	@echo $(JAEGER_BIN)

# A local Jaeger to read the demo's traces in (README): `make jaeger` starts it in the background with
# the same config, log and pid in .quayutec/jaeger/, and returns once it is healthy; `make demo` then
# traces to it; `make jaeger-stop` stops it (scripts/jaeger.py; the system's Python, no .venv needed).
jaeger: $(JAEGER_BIN)  ## Jaeger v2 in the background on loopback, to read the demo's traces in
	$(PYTHON) scripts/jaeger.py up $(JAEGER_BIN) $(JAEGER_CONFIG)

jaeger-stop:  ## stops the Jaeger of make jaeger
	$(PYTHON) scripts/jaeger.py down

protos: $(STAMP)  ## regenerates quayutec/v1 from protos/
	$(BIN)/python scripts/gen_protos.py

bench: $(STAMP) $(JAEGER_BIN)  ## every benchmark (about 30 minutes and more)
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	$(BIN)/python bench/claims.py
	$(BIN)/python bench/runs.py
	$(BIN)/python bench/wakes.py
	$(BIN)/python bench/parked.py
	$(BIN)/python bench/watch.py
	$(BIN)/python bench/inflight.py
	$(BIN)/python bench/tables.py
	$(BIN)/python bench/clients.py
	$(BIN)/python bench/statements.py
	QUAYUTEC_TEST_JAEGER_BIN=$(CURDIR)/$(JAEGER_BIN) $(BIN)/python bench/jaeger_gone.py

# Stops the embedded PostgreSQL of .quayutec first: deleting its folder under a live server leaves
# a server that no command can reach. Leaves the tree as a clone has it (tests/test_make.py checks),
# but for the dev overlay's mTLS files (`make k8s-dev-mtls`); the Go caches outside the tree stay.
clean:  ## removes everything made here (.venv, .quayutec, build/, caches, node_modules, egg-info)
	if [ -x $(BIN)/quayutec ]; then QUAYUTEC_DATA_DIR=.quayutec $(BIN)/quayutec db stop; fi
	QUAYUTEC_DATA_DIR=.quayutec $(PYTHON) scripts/jaeger.py down
	rm -rf $(VENV) .quayutec .pytest_cache .mypy_cache .ruff_cache $(NODE_EXAMPLES)/node_modules \
		$(TS_CLIENT)/node_modules $(TS_CLIENT)/dist $(OIDC_PROVIDER)/node_modules build dist
	find . -path ./.git -prune -o \( -name '*.egg-info' -o -name __pycache__ \) -type d -prune -exec rm -rf {} +
