"""The import layers of pyproject.toml's [tool.importlinter] hold (what `lint-imports` checks): the product never
imports the tests, their kit or the benchmarks; the kernels never import the service or the client; the request path
never imports a transport or the process layer's machinery, and the transports depend on the data plane, never the
other way (nor on the process layer that starts them); the client never imports the server beyond the codec and the
address format; benchmarks and the test kit never import the tests. And the check is worth something: a contract the
code breaks fails it, so the packages it reads are the real ones, not none; and the contracts that name modules one by
one name every one of them."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from importlinter.cli import lint_imports

from testkit.paths import REPO


def run_lint_imports(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], config: Path
) -> tuple[int, str]:
    """import-linter's own command on ``config``, from the repository root, without its cache in the tree."""
    monkeypatch.chdir(REPO)
    code = lint_imports(config_filename=str(config), no_cache=True, no_logo=True)
    return code, capsys.readouterr().out


def test_every_import_contract_is_kept(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = run_lint_imports(monkeypatch, capsys, REPO / "pyproject.toml")
    assert code == 0, report
    assert "0 broken" in report, report


def test_a_broken_contract_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """service/process/server.py builds the data plane, so forbidding that import must fail, naming the import."""
    config = tmp_path / "broken.toml"
    config.write_text(
        "[tool.importlinter]\n"
        'root_packages = ["indexer_service.service"]\n\n'
        "[[tool.importlinter.contracts]]\n"
        'name = "server without dataplane"\n'
        'type = "forbidden"\n'
        'source_modules = ["indexer_service.service.process.server"]\n'
        'forbidden_modules = ["indexer_service.service.dataplane"]\n'
    )
    code, report = run_lint_imports(monkeypatch, capsys, config)
    assert code == 1, report
    assert "server without dataplane BROKEN" in report, report
    assert "indexer_service.service.process.server -> indexer_service.service.dataplane" in report, report


def _contracts() -> list[dict]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def _modules(folder: Path, package: str) -> set[str]:
    """The modules and subpackages directly in ``folder``, named as installed."""
    return {f"{package}.{path.stem}" for path in folder.glob("*.py") if path.stem != "__init__"} | {
        f"{package}.{path.name}" for path in folder.iterdir() if (path / "__init__.py").exists()
    }


def test_every_module_of_the_process_layer_is_placed() -> None:
    """The request-path and transport contracts name the process layer's modules one by one (three of them only
    describe and may be read by everyone), so a new module of service/process/ must be placed in one list or the
    other: forbidden (machinery) or read by the request path."""
    contracts = _contracts()
    request_path = next(c for c in contracts if c["name"].startswith("The request path"))
    transports = next(c for c in contracts if c["name"].startswith("The transports never import"))
    package = "indexer_service.service.process"
    modules = _modules(REPO / "service" / "process", package)
    machinery = {m for m in request_path["forbidden_modules"] if m.startswith(package + ".")}
    shared = {m for m in request_path["source_modules"] if m.startswith(package + ".")}
    assert not machinery & shared
    assert machinery | shared == modules, sorted(modules ^ (machinery | shared))
    assert set(transports["forbidden_modules"]) == machinery


def test_the_client_contract_names_every_part_of_the_server() -> None:
    """The client's contract forbids the server part by part (it may import the codec and the address format), so
    a new part of service/ must be added to it or it would be importable by the client unnoticed."""
    client = next(c for c in _contracts() if c["name"].startswith("The client never imports the server"))
    service = "indexer_service.service"
    parts = (_modules(REPO / "service", service) - {f"{service}.process"}) | _modules(
        REPO / "service" / "process", f"{service}.process"
    )
    shared = {f"{service}.codec", f"{service}.process.addresses"}
    assert set(client["forbidden_modules"]) == parts - shared, sorted(
        set(client["forbidden_modules"]) ^ (parts - shared)
    )
