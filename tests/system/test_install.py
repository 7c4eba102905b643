"""The install works on any fresh machine: `make serve` and `make test` install torch's CPU build from local disk
where pip's configuration finds one, else from PyTorch's CPU wheel index (the Makefile's TORCH_CPU_INDEX), never
the multi-GB CUDA build a bare `torch` resolves to on PyPI; the README's install without make says the same.

The Makefile's own recipe is taken from `make -n` and its torch step run with --dry-run: the command it would
run, checked, with this machine's pip configuration removed (no config file, no PIP_* variables) and with a wheel
directory of its own."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

from testkit.paths import REPO

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def makefile_variable(name: str) -> str:
    (value,) = re.findall(rf"^{name} \?= (\S+)$", (REPO / "Makefile").read_text(), re.M)
    return value


def torch_step(tmp_path: Path, *make_args: str) -> list[str]:
    """The torch line of the venv recipe, as `make -n` prints it for a fresh venv whose interpreter is this one."""
    venv = tmp_path / "fresh-venv"
    command = ["make", "--no-print-directory", "-n", f"{venv}/.installed", f"VENV={venv}", f"PY={sys.executable}"]
    out = subprocess.run([*command, *make_args], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    (line,) = [line for line in out.stdout.splitlines() if "install-torch.py" in line]
    return shlex.split(line)


def without_pip_configuration(**extra: str) -> dict[str, str]:
    """This environment with no pip configuration: no PIP_* variable, and no configuration file (pip reads none
    when PIP_CONFIG_FILE is the null device)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, **extra}


def would_run(step: list[str], env: dict[str, str]) -> list[str]:
    out = subprocess.run([*step, "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return shlex.split(out.stdout.strip())


def fake_cpu_wheel(directory: Path, version: str) -> Path:
    """A wheel pip takes for torch's CPU build (name, version and tags; no code): a machine's local copy."""
    directory.mkdir()
    wheel = directory / f"torch-{version}+cpu-py3-none-any.whl"
    info = f"torch-{version}+cpu.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}+cpu\n")
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{info}/RECORD", "")
    return wheel


def test_without_a_local_wheel_torch_comes_from_the_cpu_index(tmp_path: Path) -> None:
    version = makefile_variable("TORCH_VERSION")
    assert makefile_variable("TORCH_CPU_INDEX") == CPU_INDEX
    command = would_run(torch_step(tmp_path), without_pip_configuration())
    assert command == [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        f"torch=={version}+cpu",
        "--index-url",
        CPU_INDEX,
    ]


def test_the_cpu_index_is_the_users_to_choose(tmp_path: Path) -> None:
    mirror = "https://mirror.example/pytorch/whl/cpu"
    command = would_run(torch_step(tmp_path, f"TORCH_CPU_INDEX={mirror}"), without_pip_configuration())
    assert command[-2:] == ["--index-url", mirror]


def test_a_local_cpu_wheel_is_installed_without_any_index(tmp_path: Path) -> None:
    version = makefile_variable("TORCH_VERSION")
    wheels = tmp_path / "wheels"
    fake_cpu_wheel(wheels, version)
    command = would_run(torch_step(tmp_path), without_pip_configuration(PIP_FIND_LINKS=str(wheels)))
    assert command == [sys.executable, "-m", "pip", "install", "--quiet", f"torch=={version}+cpu"]


def test_serve_and_test_install_through_that_recipe() -> None:
    makefile = (REPO / "Makefile").read_text()
    for target in ("serve", "test"):
        assert re.search(rf"^{target}: \$\(STAMP\)", makefile, re.M), target
    recipe = re.search(r"^\$\(STAMP\):.*?\n((?:\t.*\n)+)", makefile, re.M).group(1)
    lines = [line.strip() for line in recipe.splitlines()]
    assert lines.index("$(INSTALL_TORCH)") < next(n for n, line in enumerate(lines) if '-e ".[dev]"' in line)
    assert not re.search(r"pip install[^\n]*\btorch\b", recipe), "torch must come through scripts/install-torch.py"


def test_the_readme_installs_torch_the_same_way() -> None:
    """The README's install without make: the same CPU build, from the same index (or a local copy)."""
    version = makefile_variable("TORCH_VERSION")
    readme = (REPO / "README.md").read_text()
    lines = [line for line in readme.splitlines() if re.match(r"\s*pip install .*\btorch==", line)]
    assert lines, "the README installs torch without make"
    for line in lines:
        words = shlex.split(line, comments=True)
        assert f"torch=={version}+cpu" in words and words[words.index("--index-url") + 1] == CPU_INDEX, line


def test_after_make_serve_the_readmes_commands_work_as_written() -> None:
    """`make serve` installs into .venv, which is not on the PATH: every README command line that runs the service's
    command names .venv/bin/, but in the block that activates the venv itself (the install without make)."""
    readme = (REPO / "README.md").read_text()
    bare = []
    for block in re.findall(r"^```bash\n(.*?)^```$", readme, re.M | re.S):
        if ". .venv/bin/activate" in block:
            continue
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] in ("indexer-service", "python", "pytest"):
                bare.append(line)
    assert not bare, f"README lines that need the venv on the PATH: {bare}"
