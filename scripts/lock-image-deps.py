#!/usr/bin/env python3
"""Writes requirements/image-cpu.txt and requirements/image-gpu.txt: the exact files the image installs, by hash.

    python scripts/lock-image-deps.py            # needs uv (`pip install uv`), PyPI and the PyTorch index
    python scripts/lock-image-deps.py --check    # offline: fails when an input changed since the last lock

Inputs: pyproject.toml's [project] dependencies and its build backend ([build-system] requires: the image builds
the project with --no-build-isolation, so the backend comes from the lock too), and requirements/image.in (the
torch and Triton pins). Their hash is written into each lock's header, so --check (and the deploy tests) can
tell a stale lock without the network.

Every requirement carries `--hash=sha256:` lines (uv's --generate-hashes: every file of that version the index
has), and the Dockerfile installs the lock with `pip install --require-hashes --no-deps`: a file that is not
byte for byte the one locked here fails the build, whichever index served it.

- image-cpu.txt: everything of the CPU variant, torch's CPU build included (`torch==X+cpu`). Its first line
  `--find-links https://download.pytorch.org/whl/torch/` tells pip in the image where that build is; this
  script's resolver looks there too unless TORCH_FIND_LINKS names another place (a local wheel directory holding
  the same files: the hash is of the file, so it is the published wheel's).
- image-gpu.txt: what the GPU base image lacks. torch and Triton are left out: the base (pytorch/pytorch,
  pinned by digest in the Dockerfile) brings the CUDA build of torch and the Triton it was built with, and pip
  must never swap either.
Resolved for x86_64 Linux (glibc 2.28+) and each base's Python (LOCK_PYTHON below).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "requirements"
IMAGE_IN = REQUIREMENTS / "image.in"
LOCKS = {"cpu": REQUIREMENTS / "image-cpu.txt", "gpu": REQUIREMENTS / "image-gpu.txt"}
# Where the image's pip finds torch's CPU build (written into image-cpu.txt), and where this script's resolver
# looks for it unless TORCH_FIND_LINKS says otherwise.
TORCH_FIND_LINKS = "https://download.pytorch.org/whl/torch/"
# Provided by the GPU base image, never by pip in it.
GPU_BASE_PROVIDES = {"torch", "triton"}
# The Python of each base image (the Dockerfile's CPU_BASE and GPU_BASE).
LOCK_PYTHON = {"cpu": "3.11", "gpu": "3.12"}


def project_dependencies() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def build_requirements() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]


def image_pins() -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in IMAGE_IN.read_text().splitlines())
    return [line for line in lines if line]


def name_of(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def inputs_digest() -> str:
    text = "\n".join([*project_dependencies(), "--", *build_requirements(), "--", *image_pins()])
    return hashlib.sha256(text.encode()).hexdigest()


def header(variant: str) -> str:
    """The lock's header; its `# python:` line is the Python it was resolved for, which the image's build checks
    against its base's before installing anything."""
    return (
        f"# The {variant.upper()} image's Python dependencies, pinned by hash.\n"
        "# GENERATED: python scripts/lock-image-deps.py\n"
        f"# inputs-sha256: {inputs_digest()}\n"
        f"# python: {LOCK_PYTHON[variant]}\n"
    )


def cpu_build(requirement: str) -> str:
    """``torch==X`` as its CPU build, ``torch==X+cpu`` (PyPI's Linux torch X is the multi-GB CUDA build)."""
    if name_of(requirement) == "torch" and "==" in requirement and "+" not in requirement:
        return requirement + "+cpu"
    return requirement


def compile_lock(variant: str, uv: str) -> str:
    requirements = [*project_dependencies(), *build_requirements(), *image_pins()]
    if variant == "cpu":
        requirements = [cpu_build(r) for r in requirements]
    else:
        requirements = [r for r in requirements if name_of(r) not in GPU_BASE_PROVIDES]
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / f"image-{variant}.in"
        source.write_text("\n".join(requirements) + "\n")
        command = [
            uv,
            "pip",
            "compile",
            str(source),
            "--quiet",
            "--no-header",
            "--annotation-style=line",
            "--generate-hashes",
            f"--python-version={LOCK_PYTHON[variant]}",
            "--python-platform=x86_64-manylinux_2_28",
        ]
        if variant == "cpu":
            command += ["--find-links", os.environ.get("TORCH_FIND_LINKS", TORCH_FIND_LINKS)]
        out = subprocess.run(command, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise SystemExit(f"uv pip compile ({variant}) failed:\n{out.stderr}")
    # The annotations name the temporary input file; "-r inputs" (the project, image.in, the build backend) is stable.
    body = re.sub(r"-r \S+image-(cpu|gpu)\.in", "-r inputs", out.stdout)
    if variant == "cpu":
        body = f"--find-links {TORCH_FIND_LINKS}\n" + body
    return header(variant) + body


def main(argv: list[str]) -> int:
    if "--check" in argv:
        stamp = f"inputs-sha256: {inputs_digest()}"
        stale = [p for p in LOCKS.values() if not p.exists() or stamp not in p.read_text()]
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run python scripts/lock-image-deps.py", file=sys.stderr)
        return 1 if stale else 0
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        raise SystemExit("uv not found: pip install uv (or set UV=/path/to/uv)")
    for variant, path in LOCKS.items():
        path.write_text(compile_lock(variant, uv))
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
