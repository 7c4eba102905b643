# Two commands on a fresh machine: `make serve` and `make test`. Both install what is missing first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test test-deps test-quick image-test lint protos docs clean

# torch first, as its CPU build (torch==$(TORCH_VERSION)+cpu): a bare `torch` requirement would make pip fetch the
# multi-GB CUDA build from PyPI. From local disk where pip's own configuration finds it (find-links), else from
# PyTorch's CPU wheel index, TORCH_CPU_INDEX (override it for a mirror): scripts/install-torch.py decides, and says
# which. The GPU image brings its own torch and skips this step.
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
INSTALL_TORCH = $(PYTHON) scripts/install-torch.py --python $(PY) --version $(TORCH_VERSION) --cpu-index $(TORCH_CPU_INDEX)

# Each step says what it does in one line (pip itself runs quiet: its own output is a few hundred lines). A fresh
# install took 478 s on the 2-core machine under a load average of 9 (venv 31 s, pip 15 s, torch 94 s, the rest 337 s).
$(STAMP): pyproject.toml setup.py service/compute/fastpath.c service/overload/budget.c protos/indexer/v1/indexer_wire.h
	@echo "creating the virtual environment $(VENV) with $$($(PYTHON) --version) ..."
	@$(PYTHON) -m venv $(VENV)
	@echo "upgrading pip in $(VENV) ..."
	@$(PY) -m pip install -q --upgrade pip
	@$(INSTALL_TORCH)
	@echo "installing indexer-service (editable, with its dev extra) and its dependencies into $(VENV)," \
		"compiling its two C extensions (the longest step) ..."
	@$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)
	@echo "$(VENV) is ready ($(VENV)/bin/indexer-service, $(VENV)/bin/python)"

serve: $(STAMP)
	$(VENV)/bin/indexer-service serve

# pytest-xdist workers for `make test` (0: none; TEST_WORKERS=0 runs without). 3 on this 2-core machine: one runs
# the `exclusive` tests one after the other (mostly waiting on their sieges' timers, about half a CPU), the other
# two run beside them at niceness 10 (tests/tiers.py), taking the CPU time they leave, so that one's waits (servers
# starting, timers, tools) are the other's CPU time: 267-282 s for pytest on the 2-CPU Intel Xeon VM, `make test` 4 min
# 41 s with the tools present (322-378 s on the earlier AMD EPYC VM; there 374-413 s with those two pinned to one
# CPU instead, 394 s with 4 workers, 466-468 s with 2 workers).
# The suite then keeps both CPUs about 92 % busy: its own CPU time, not its waits, is what makes it last.
# loadgroup spreads tests one by one, except the groups tests/tiers.py makes (process tests sharing a module-scoped
# fixture).
TEST_WORKERS ?= 3
XDIST := -n $(TEST_WORKERS) --dist loadgroup

# The whole suite (CI's command). Debian's prometheus (promtool) and kustomize for the deploy tests, and the
# other-language clients' tools: installed only when missing. REQUIRE_TEST_TOOLS=1: a test whose tool is still
# missing fails instead of skipping (tests/tools.py), as it would skip under a bare `python -m pytest tests`.
test: $(STAMP)
	bash scripts/install-deploy-tools.sh $(VENV)
	bash scripts/install-client-tools.sh
	REQUIRE_TEST_TOOLS=1 $(PY) -m pytest -q $(XDIST)

# The dependency ends (CI runs it after `make test`): the transport, health, flood and HTTP tests and four attack
# rows (`benchmarks.attack --check`) at the declared lower bounds and at the newest releases within pyproject.toml's
# ranges of grpcio (with its health and reflection packages), protobuf, prometheus-client and uvicorn[standard], each
# end in a venv of its own under .venv-deps/ that installs only those and borrows the rest from $(VENV); rebuilt only
# when the versions change (scripts/test-deps.py). Both ends, one after the other, on this 2-core machine while other
# jobs shared it: 292 s with the venvs already made (load average 5-7; each end's tests 111-126 s of it), 513 s
# making both venvs first under load average 5-15 (each venv 12-21 s, the rest the tests slowed by the load).
test-deps: $(STAMP)
	$(PY) scripts/test-deps.py

# The inner loop: the kernels and the in-process service tests, without the tests that start processes (marked
# `process` at collection: tests/tiers.py), the `slow` ones and the GPU ones: 57 s on 2 CPUs (docs/testing.md).
# No workers: each would import torch and Triton first, and 2 workers took longer than none, back to back here.
test-quick: $(STAMP)
	$(PY) -m pytest -q -m "not process and not slow and not gpu" tests/kernels tests/service

# The CPU image users deploy: built with docker or podman (whichever answers here; podman and buildah installed from
# the distribution where neither is), on the pinned base where its registry answers, else on the same base made here
# from Debian's packages; then run as deploy/base runs its pod and checked from outside (tests/deploy/image.py).
image-test: $(STAMP)
	$(PY) -m tests.deploy.image

# Style, then the import layers of pyproject.toml's [tool.importlinter] (tests/system/test_import_layers.py too).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

# The server's generated code (grpcio-tools), then the light client's version-neutral modules made from it.
protos: $(STAMP)
	$(PY) -m indexer_service.protos.generate
	$(PY) clients/python/generate.py

# docs/service.md's settings table, from the settings' help texts in service/config/settings.py.
docs: $(STAMP)
	$(PY) -m indexer_service.service.config.settings_table

clean:
	rm -rf $(VENV) .venv-deps
