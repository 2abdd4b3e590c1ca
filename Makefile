# The two commands a newcomer needs: `make run` and `make test`.
# Both create .venv and install what they need on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# CPU build for tests and demos; GPU users: make TORCH_SPEC='torch>=2.3' ...
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: run test test-heavy test-ray compile lint typecheck pytest deploy-check docs docs-gen docs-diagrams docs-page bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check '$(TORCH_SPEC)'
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/pinfeed serve --demo

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples docs
	$(BIN)/ruff format --check src tests bench examples docs

typecheck: $(STAMP)
	$(BIN)/mypy -p pinfeed -p pinfeed_server

# pip compiles an installed package; an editable one is compiled by its first import,
# and not at all where PYTHONDONTWRITEBYTECODE is set (CI's machines): then every server
# and trainer process the tests start compiles pinfeed again (~0.5 s each). Incremental.
compile: $(STAMP)
	$(BIN)/python -m compileall -q src tests bench examples docs

# Two passes (pyproject's [tool.pytest.ini_options] says why): the parallel one, then the
# tests that measure the machine, alone. PYTEST_WORKERS=auto: one worker per CPU.
PYTEST_WORKERS ?= 2
pytest: $(STAMP) compile
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile -m 'not serial and not heavy and not slow'
	$(BIN)/pytest -m 'serial and not heavy and not slow'

# Tests that run many processes at once or a whole deployment (torchrun and Lightning DDP
# jobs of 2-6 ranks, Docker images and compose stacks, two nodes, the benchmarks' smoke
# runs and objects, fifty trainer processes in a row), and the `slow` ones (10 s or more
# each: a server killed and restarted, a script's whole life): minutes of their own, so
# not in `make test`, which keeps to 10 minutes; CI runs both. The same two passes.
test-heavy: $(STAMP) compile
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile -m '(heavy or slow) and not serial'
	$(BIN)/pytest -m '(heavy or slow) and serial'

test: lint typecheck deploy-check docs pytest

# The documentation site (mkdocs.yml, docs/) into build/site: --strict fails on a broken
# link or anchor. tests/docs opens it in a headless Chromium, offline.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The reference pages' generated tables (HTTP API, CLI, settings, metrics, loader fields,
# dataset kinds, errors), rewritten from the code; tests/docs/test_reference.py fails
# when a committed page differs. The benchmark tables: python -m bench report.
docs-gen: $(STAMP)
	$(BIN)/python -m docs.gen

# The diagrams (docs/**/*.mmd, Mermaid) drawn as SVG by Mermaid in headless Chromium
# (mermaid from the npm registry, kept in .cache/); tests/docs checks each is current.
docs-diagrams: $(STAMP)
	$(BIN)/python -m docs.diagrams

# docs/page.png, the operator's page of a node running three trainers under the arbiter
# (a real server and trainers, headless Chromium; about a minute).
docs-page: $(STAMP)
	$(BIN)/python -m tests.browser docs/page.png

# tests/ray: a real Ray cluster (a head, two workers, the server's node) in network
# namespaces of its own; needs root. Heavy, so not in `make test`; CI runs both.
test-ray: $(STAMP) compile
	PINFEED_TEST_RAY=1 $(BIN)/pytest tests/ray

# Deployment files, checked offline: hadolint, the Compose Specification's JSON schema
# (vendored in check-jsonschema), Kubernetes schemas (vendored in kubernetes-validate).
# The compose smoke test and the 64 MB /dev/shm test are in tests/deploy (pytest).
COMPOSE_FILES := docker-compose.yml deploy/compose.memlock.yml deploy/two-node/node0.compose.yml \
                 deploy/two-node/node1.compose.yml deploy/ray/compose.yml
deploy-check: $(STAMP)
	$(BIN)/hadolint Dockerfile
	$(BIN)/check-jsonschema --builtin-schema vendor.compose-spec $(COMPOSE_FILES)
	$(BIN)/kubernetes-validate --strict --quiet deploy/k8s/pinfeed.yaml

bench: $(STAMP) compile
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache build/site build/site-home.png
