#!/usr/bin/env python3
"""Installs torch's CPU build into a virtual environment, from local disk where pip finds it there, else from
PyTorch's CPU wheel index: never the multi-GB CUDA build that a bare `torch==X` resolves to on PyPI.

    python3 scripts/install-torch.py --python .venv/bin/python --version 2.13.0 --cpu-index URL
    python3 scripts/install-torch.py ... --dry-run      # print the pip command it would run, install nothing

`make serve` and `make test` run it (the Makefile's TORCH_VERSION and TORCH_CPU_INDEX, which a user may
override: `make test TORCH_CPU_INDEX=https://mirror.example/whl/cpu`). "Local" is whatever pip's own
configuration finds without an index (`find-links` in pip.conf or PIP_FIND_LINKS): asked of pip itself with
`--dry-run --no-index`, so a machine with a wheel directory installs offline and any other machine from the index.
The requirement is the CPU build's own version, `torch==X+cpu`, wherever it comes from.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path


def requirement(version: str) -> str:
    return f"torch=={version}+cpu"


def found_locally(python: str, version: str) -> bool:
    """Whether ``python``'s pip, with its configuration, finds the CPU build without any index."""
    probe = [python, "-m", "pip", "install", "--dry-run", "--quiet", "--no-deps", "--no-index", "--ignore-installed"]
    try:
        done = subprocess.run([*probe, requirement(version)], capture_output=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def install_command(python: str, version: str, cpu_index: str, local: bool) -> list[str]:
    command = [python, "-m", "pip", "install", "--quiet", requirement(version)]
    # The CPU index serves torch's own dependencies too; --index-url replaces only the configured index.
    return command if local else [*command, "--index-url", cpu_index]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", required=True, help="the virtual environment's interpreter to install into")
    parser.add_argument("--version", required=True, help="torch's version, e.g. 2.13.0 (its CPU build is X+cpu)")
    parser.add_argument("--cpu-index", required=True, help="PyTorch's CPU wheel index, where no local copy is found")
    parser.add_argument("--dry-run", action="store_true", help="print the pip command, install nothing")
    args = parser.parse_args(argv)
    local = found_locally(args.python, args.version)
    command = install_command(args.python, args.version, args.cpu_index, local)
    where = "a local copy (pip's find-links)" if local else args.cpu_index
    if args.dry_run:
        print(shlex.join(command))
        return 0
    venv = Path(args.python).parent.parent
    print(f"installing torch's CPU build ({requirement(args.version)}) from {where} into {venv} ...", flush=True)
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
