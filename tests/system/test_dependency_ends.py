"""`make test-deps` (scripts/test-deps.py) tests what pyproject.toml declares: each end pins every transport
library within its declared range, the lowest end at the declared lower bounds, and what it runs exists."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
import types

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from testkit.paths import REPO

SCRIPT = REPO / "scripts" / "test-deps.py"


def load_script() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("test_deps_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # its dataclasses look their module up there
    spec.loader.exec_module(script)
    return script


def declared() -> dict[str, Requirement]:
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {canonicalize_name(r.name): r for r in map(Requirement, dependencies)}


def test_each_end_pins_the_transport_libraries_within_the_declared_ranges() -> None:
    """The plan as the target computes it (pip's resolver against the index; nothing installed)."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--print-plan"], capture_output=True, text=True, cwd=REPO, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ends = json.loads(done.stdout)["ends"]
    ranges = declared()
    libraries = {canonicalize_name(name) for name in load_script().TRANSPORT_LIBRARIES}
    assert set(ends) == {"lowest", "newest"}
    for end, plan in ends.items():
        assert set(plan["pins"]) == libraries, (end, plan["pins"])
        for name, version in plan["pins"].items():
            assert ranges[name].specifier.contains(version, prereleases=True), (end, name, version, ranges[name])
            assert plan["installs"][name] == version, (end, name, plan["installs"])
    for name, version in ends["lowest"]["pins"].items():
        (bound,) = [s.version for s in ranges[name].specifier if s.operator == ">="]
        assert Version(version) == Version(bound), (name, version, ranges[name])
        assert Version(ends["newest"]["pins"][name]) >= Version(version), (name, ends["newest"]["pins"][name])


def test_every_test_and_attack_row_it_runs_exists() -> None:
    """A renamed test or row would otherwise surface only when `make test-deps` runs."""
    script = load_script()
    for entry in script.TESTS:
        path, _, name = entry.partition("::")
        assert (REPO / path).is_file(), entry
        if name:
            function = name.split("[")[0]
            assert re.search(rf"^def {function}\(", (REPO / path).read_text(), re.M), entry
    attack = ast.parse((REPO / "benchmarks" / "attack.py").read_text())
    (targets,) = [
        node.value
        for node in attack.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "TARGETS"
    ]
    rows_with_targets = {key.value for key in targets.keys}
    assert set(script.ATTACK_ROWS) <= rows_with_targets, "every row test-deps runs is held to targets (--check)"
