"""The repository stands alone: nothing in it reads or cites a folder beside it, and the whole suite collects
from a copy of its files with nothing next to that copy (as on a fresh clone)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.paths import REPO

# Where the copy's indexer_service comes from, and whether the compiled fast path can be imported there.
WHERE_FROM = """
import importlib.util
import indexer_service.kernels as kernels
print(kernels.__file__)
print("present" if importlib.util.find_spec("indexer_service.service.compute._fastpath") else "absent")
"""
WITHOUT_EDITABLE_INSTALL = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
"""
# Spelled in two parts so this file does not match its own check.
SIBLING = "../" + "shared"


def repository_files() -> list[str]:
    """Tracked files, plus untracked ones git does not ignore (work in progress in this tree); on a clean clone
    that is exactly the tracked set. Files deleted in the working tree are left out."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return sorted({name for name in listed.split("\0") if name and (REPO / name).is_file()})


@pytest.fixture(scope="module")
def files() -> list[str]:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: no file list to copy")
    return repository_files()


def test_no_file_reads_or_cites_a_sibling_folder(files: list[str]) -> None:
    offenders = []
    for name in files:
        data = (REPO / name).read_bytes()
        for marker in (SIBLING.encode(), b"INDEXER_" + b"SHARED_DIR"):
            if marker in data:
                line = data[: data.index(marker)].count(b"\n") + 1
                offenders.append(f"{name}:{line}: {marker.decode()}")
    assert not offenders, "files that reach outside the repository:\n" + "\n".join(offenders)


def copy_repository(files: list[str], copy: Path) -> None:
    for name in files:
        target = copy / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)


def test_suite_collects_from_a_lone_copy(files: list[str], tmp_path: Path) -> None:
    # tmp_path/alone/ holds the copy and nothing else, so a relative "../<anything>" finds nothing.
    copy = tmp_path / "alone" / "indexer-service"
    copy_repository(files, copy)
    # The compiled fast path is a build output (git ignores *.so) that `make test`'s install step makes on a
    # fresh clone; bring this tree's build along rather than compile it again.
    for built in (REPO / "service" / "compute").glob("_fastpath*.so"):
        shutil.copy2(built, copy / "service" / "compute" / built.name)
    assert list((tmp_path / "alone").iterdir()) == [copy]

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("INDEXER_")}
    which = subprocess.run(
        [sys.executable, "-c", "import service, tests.golden as g; print(service.__file__); print(g.GOLDEN_PATH)"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert which.returncode == 0, which.stderr
    assert all(line.startswith(str(copy)) for line in which.stdout.split()), which.stdout

    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "error" not in output.lower().split("\n")[-2], output[-4000:]
    assert " tests collected" in output or " test collected" in output, output[-2000:]


def test_kernel_tests_pass_without_the_compiled_extension(files: list[str], tmp_path: Path) -> None:
    """tests/kernels/ needs neither the service nor its compiled fast path: in a copy without
    service/compute/_fastpath*.so, whose ``indexer_service.*`` is the copy's own (a package folder of links on
    PYTHONPATH, ahead of this checkout's editable install), the kernel tests collect and pass."""
    copy = tmp_path / "alone" / "indexer-service"
    copy_repository(files, copy)
    assert not list((copy / "service" / "compute").glob("_fastpath*.so")), "the copy has a compiled extension"
    mapping = tmp_path / "mapping" / "indexer_service"
    mapping.mkdir(parents=True)
    for folder in ("kernels", "service", "protos"):  # pyproject's package-dir
        (mapping / folder).symlink_to(copy / folder, target_is_directory=True)
    # This checkout's editable install answers for indexer_service.* after PYTHONPATH does, and so would still
    # find its own service/compute/_fastpath*.so: the copy's interpreter drops it at startup.
    (mapping.parent / "sitecustomize.py").write_text(WITHOUT_EDITABLE_INSTALL)
    env = {k: v for k, v in os.environ.items() if not k.startswith("INDEXER_")}
    env["PYTHONPATH"] = str(mapping.parent)

    which = subprocess.run(
        [sys.executable, "-c", WHERE_FROM], cwd=copy, env=env, capture_output=True, text=True, timeout=120
    )
    assert which.returncode == 0, which.stderr
    kernels, fastpath = which.stdout.split()
    assert kernels.startswith(str(mapping)) and fastpath == "absent", which.stdout

    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "tests/kernels"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert " passed" in output and " failed" not in output and " error" not in output, output[-2000:]
