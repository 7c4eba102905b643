# Two commands on a fresh machine: `make serve` and `make test`. Both install what is missing first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint protos docs clean

# torch is pinned to the CPU build that lies on local disk (PIP_FIND_LINKS); a bare `torch` requirement
# would make pip fetch a multi-GB CUDA build. The GPU image brings its own torch and skips this step.
$(STAMP): pyproject.toml setup.py service/fastpath.c protos/indexer/v1/indexer_wire.h
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/indexer-service serve

# Debian's prometheus (promtool) and kustomize for the deploy tests: installed only when missing.
test: $(STAMP)
	bash scripts/install-deploy-tools.sh $(VENV)
	bash scripts/install-client-tools.sh
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

protos: $(STAMP)
	$(PY) -m indexer_service.protos.generate

# docs/service.md's settings table, from the settings' help texts in service/config.py.
docs: $(STAMP)
	$(PY) -m indexer_service.service.settings_table

clean:
	rm -rf $(VENV)
