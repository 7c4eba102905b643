#!/usr/bin/env python3
"""Writes requirements/image-cpu.txt and requirements/image-gpu.txt: the exact versions the image installs.

    python scripts/lock-image-deps.py            # needs uv (`pip install uv`) and PyPI; about a second
    python scripts/lock-image-deps.py --check    # offline: fails when an input changed since the last lock

Inputs: pyproject.toml's [project] dependencies, requirements/image.in (the Triton pin) and the Dockerfile's
TORCH_VERSION. Their hash is written into each lock's header, so --check (and tests/deploy/test_static.py) can
tell a stale lock without the network.

- image-cpu.txt: everything of the CPU variant, torch's CPU build included (`torch==X+cpu`, from the PyTorch
  CPU wheel index: TORCH_FIND_LINKS overrides where the resolver finds it, e.g. a local wheel directory).
- image-gpu.txt: what `pip install .` adds to the GPU base image. torch and Triton are left out: the base
  (pytorch/pytorch, pinned in the Dockerfile) brings the CUDA build of torch and the Triton it was built with,
  and pip must never swap either.
Both are for Python 3.11 on x86_64 Linux (glibc 2.28+), the two base images.
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
DEFAULT_TORCH_FIND_LINKS = "https://download.pytorch.org/whl/torch/"
# Provided by the GPU base image, never by pip in it.
GPU_BASE_PROVIDES = {"torch", "triton"}


def project_dependencies() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def torch_version() -> str:
    match = re.search(r"^ARG TORCH_VERSION=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M)
    if match is None:
        raise SystemExit("Dockerfile has no ARG TORCH_VERSION=...")
    return match.group(1).strip('"')


def image_pins() -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in IMAGE_IN.read_text().splitlines())
    return [line for line in lines if line]


def name_of(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def inputs_digest() -> str:
    text = "\n".join([*project_dependencies(), "--", *image_pins(), "--", f"torch=={torch_version()}"])
    return hashlib.sha256(text.encode()).hexdigest()


def header(variant: str) -> str:
    return (
        f"# The {variant.upper()} image's Python dependencies, pinned. GENERATED: python scripts/lock-image-deps.py\n"
        f"# inputs-sha256: {inputs_digest()}\n"
    )


def compile_lock(variant: str, uv: str) -> str:
    if variant == "cpu":
        requirements = [*project_dependencies(), *image_pins(), f"torch=={torch_version()}+cpu"]
    else:
        requirements = [r for r in [*project_dependencies(), *image_pins()] if name_of(r) not in GPU_BASE_PROVIDES]
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / f"image-{variant}.in"
        source.write_text("\n".join(requirements) + "\n")
        command = [
            uv, "pip", "compile", str(source), "--quiet", "--no-header", "--annotation-style", "line",
            "--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28",
        ]  # fmt: skip
        if variant == "cpu":
            command += ["--find-links", os.environ.get("TORCH_FIND_LINKS", DEFAULT_TORCH_FIND_LINKS)]
        out = subprocess.run(command, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise SystemExit(f"uv pip compile ({variant}) failed:\n{out.stderr}")
    # The annotations name the temporary input file; "-r inputs" (the project, image.in, torch) is stable.
    body = re.sub(r"-r \S+image-(cpu|gpu)\.in", "-r inputs", out.stdout)
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
