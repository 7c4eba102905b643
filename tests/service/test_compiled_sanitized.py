"""The compiled modules built with AddressSanitizer and UndefinedBehaviorSanitizer, and with their test seams, their
tests running again against those builds in one subprocess (an instrumented interpreter takes seconds to start:
once for both); any sanitizer report fails the test. The compile also holds each file to zero warnings under -Wall
-Wextra.

- service/compute/fastpath.c: tests/service/test_fastpath.py (golden cases, every boundary, hypothesis-generated and
  mutated requests, the size pass made wrong on purpose) and tests/service/test_fastpath_contract.py (limits read by
  name);
- service/overload/budget.c: tests/service/test_budget_books.py (its Python twin's random sequences, the watchdog's
  entry, reference cycles, the fast path's admission through the data plane).

gcc's sanitizer runtimes (libasan, libubsan) come with gcc itself on Debian (gcc-12 depends on libgcc-12-dev,
which depends on libasan8 and libubsan1), so a machine that builds the extensions can run this test. The Python
interpreter is not instrumented: the runtimes are preloaded, and only the C files' own accesses are checked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit.paths import REPO

SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]


@dataclass(frozen=True)
class Compiled:
    """A compiled module: its C file, the module it builds, the tests that run against it, the build's extra flags."""

    source: str
    module: str
    tests: tuple[str, ...]
    flags: tuple[str, ...] = ()


COMPILED = {
    "fastpath": Compiled(
        "service/compute/fastpath.c",
        "indexer_service.service.compute._fastpath",
        ("tests/service/test_fastpath.py", "tests/service/test_fastpath_contract.py"),
        ("-DFASTPATH_TEST_SEAMS",),
    ),
    "budget": Compiled(
        "service/overload/budget.c", "indexer_service.service.overload._budget", ("tests/service/test_budget_books.py",)
    ),
}

# Loads each sanitized build as its module (argv 1: JSON, module name to file) before anything imports the installed
# one, then runs pytest with the rest of argv.
BOOTSTRAP = """
import importlib, importlib.util, json, sys
for name, path in json.loads(sys.argv[1]).items():
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    package, _, leaf = name.rpartition(".")
    sys.modules[name] = module
    setattr(importlib.import_module(package), leaf, module)
import pytest
sys.exit(pytest.main(sys.argv[2:]))
"""


def _gcc() -> str:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed (it also builds the extension itself)")
    return gcc


def _build(gcc: str, compiled: Compiled, out: Path) -> Path:
    """The extension with both sanitizers and its test seams, -O1 -g for readable reports."""
    target = out / (compiled.module.rpartition(".")[2] + sysconfig.get_config_var("EXT_SUFFIX"))
    command = [
        gcc,
        "-shared",
        "-fPIC",
        "-O1",
        "-g",
        "-std=c11",
        "-Wall",
        "-Wextra",
        "-Werror",
        *SANITIZE,
        *compiled.flags,
        f"-I{sysconfig.get_paths()['include']}",
        str(REPO / compiled.source),
        "-o",
        str(target),
    ]
    built = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, f"{' '.join(command)}\n{built.stderr}"
    return target


def _runtime(gcc: str, name: str) -> str:
    path = subprocess.run([gcc, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    assert os.path.isabs(path) and os.path.exists(path), f"gcc has no {name}: install libasan and libubsan"
    return path


def test_the_tests_of_each_compiled_module_pass_under_asan_and_ubsan(tmp_path: Path) -> None:
    gcc = _gcc()
    modules = {compiled.module: str(_build(gcc, compiled, tmp_path)) for compiled in COMPILED.values()}
    tests = [test for compiled in COMPILED.values() for test in compiled.tests]
    # pytest captures file descriptor 2 and a sanitizer ends the process before pytest prints it: reports go to
    # files instead, one per process, named <log>.<pid>.
    log = tmp_path / "sanitizer"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASAN_", "UBSAN_", "LD_PRELOAD", "PYTHONMALLOC"))}
    env.update(
        LD_PRELOAD=f"{_runtime(gcc, 'libasan.so')} {_runtime(gcc, 'libubsan.so')}",
        # CPython frees little at exit by design: leaks would be its, not the C file's.
        ASAN_OPTIONS=f"detect_leaks=0:log_path={log}",
        UBSAN_OPTIONS=f"halt_on_error=1:print_stacktrace=1:log_path={log}",
        # Every object from malloc, so that ASan guards each one: pymalloc would put small bytes objects (most
        # responses) side by side in its own arenas, where a write past one lands in the next, unseen.
        PYTHONMALLOC="malloc",
        # A quarter of the hypothesis examples (the full count runs in the plain suite): the run stays within ~60 s
        # on two cores, and every other test of the file runs whole.
        FASTPATH_FUZZ_EXAMPLES="150",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    command = [
        sys.executable,
        "-c",
        BOOTSTRAP,
        json.dumps(modules),
        "-q",
        "-p",
        "no:cacheprovider",
        "-rs",
        *(str(REPO / test) for test in tests),
    ]
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    reports = "\n".join(p.read_text(errors="replace") for p in sorted(tmp_path.glob("sanitizer.*")))
    assert not reports, reports[:8000]
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-8000:]
    # Every test ran, the seams' included (they skip only without the test build).
    assert " passed" in output and "skipped" not in output, output[-4000:]
