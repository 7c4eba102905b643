"""Issue 18: everything the image build pulls is pinned. The base images by digest (a tag can be pushed again, a
digest cannot), no frontend image by tag, and every Python file by hash (pip's --require-hashes)."""

from __future__ import annotations

import importlib.util
import re

import pytest

from tests.deploy.support import (
    DOCKERFILE,
    LOCKS,
    ROOT,
    dockerfile_arg_defaults,
    dockerfile_instructions,
    read_lock,
    substitute,
)

PINNED_IMAGE = re.compile(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}")
VARIANTS = tuple(LOCKS)


def unpinned_images(text: str) -> list[str]:
    """Every image a Dockerfile pulls by tag alone, for every VARIANT: FROM lines with the ARG defaults
    substituted (a FROM naming an earlier stage pulls nothing) and a `# syntax=` frontend."""
    instructions = dockerfile_instructions(text)
    unpinned = [line for line in re.findall(r"^#\s*syntax=(\S+)", text, re.M) if not PINNED_IMAGE.fullmatch(line)]
    for variant in VARIANTS:
        args = {**dockerfile_arg_defaults(instructions), "VARIANT": variant}
        stages: set[str] = set()
        for ins in instructions:
            if ins.keyword != "FROM":
                continue
            image, *alias = substitute(ins.args, args).split()
            if image not in stages and not PINNED_IMAGE.fullmatch(image):
                unpinned.append(image)
            if alias:
                stages.add(alias[-1])
    return list(dict.fromkeys(unpinned))


def test_every_image_the_build_pulls_is_pinned_by_digest() -> None:
    assert unpinned_images(DOCKERFILE.read_text()) == []


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (r"(ARG CPU_BASE=docker.io/library/python:3.11-slim-bookworm)@sha256:[0-9a-f]{64}", r"\1"),
        (r"\A", "# syntax=docker/dockerfile:1\n"),
    ],
    ids=["base by tag", "frontend by tag"],
)
def test_the_pin_check_catches_an_image_by_tag(old: str, new: str) -> None:
    """The check above is worth something only if a base by tag alone, or a frontend by tag, fails it."""
    text, n = re.subn(old, new, DOCKERFILE.read_text(), count=1)
    assert n == 1 and unpinned_images(text), new


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_locked_requirement_carries_its_hashes(variant: str) -> None:
    lock = read_lock(LOCKS[variant])
    assert len(lock.pins) >= 10
    for name, hashes in lock.hashes.items():
        assert hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), name


def test_cpu_lock_tells_pip_where_torch_cpu_build_is() -> None:
    """torch==X+cpu is on the PyTorch index only: the CPU lock names it (the address scripts/lock-image-deps.py
    resolves against), the GPU lock needs none."""
    spec = importlib.util.spec_from_file_location("lock_image_deps", ROOT / "scripts" / "lock-image-deps.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert read_lock(LOCKS["cpu"]).options == (f"--find-links {script.TORCH_FIND_LINKS}",)
    assert read_lock(LOCKS["gpu"]).options == ()
