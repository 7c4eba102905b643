"""The tests that need a tool `make test` installs beyond the venv (scripts/install-client-tools.sh: Go and its
generators, Node and the Node client's modules, buf, protoc; scripts/install-deploy-tools.sh: kustomize or kubectl,
promtool, prometheus; the dev extra's grpcurl, hadolint and atheris) say so with :func:`needs_tool`. Run bare
(``python -m pytest tests``) where the tool is missing, such a test skips with the reason; where
REQUIRE_TEST_TOOLS=1, which `make test` (and so CI) sets after installing them, it fails with the reason instead:
a missing tool cannot pass unnoticed as a skip there. tests/conftest.py applies the marker. (The variable is not an
INDEXER_* one: those are the service's settings, and the server warns of one it does not know.)"""

from __future__ import annotations

import os

import pytest

REQUIRE_TOOLS = "REQUIRE_TEST_TOOLS"


def needs_tool(missing: str | None) -> pytest.MarkDecorator:
    """The mark of a test that needs a tool: ``missing`` is why it cannot run here (None: it can)."""
    return pytest.mark.needs_tool(missing)


def tools_required() -> bool:
    return os.environ.get(REQUIRE_TOOLS, "") == "1"


def missing_tool(item: pytest.Item) -> None:
    """Skips ``item`` (or fails it, where tools are required) if a tool it needs is missing."""
    for mark in item.iter_markers("needs_tool"):
        missing = mark.args[0] if mark.args else None
        if missing and tools_required():
            pytest.fail(f"{missing} ({REQUIRE_TOOLS}=1: `make test` installs it before the tests)", pytrace=False)
        if missing:
            pytest.skip(missing)
