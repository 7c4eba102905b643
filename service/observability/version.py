"""The server's version, from the installed package's metadata (pyproject.toml's ``version``, the one source), the
commit it was built from and the image's revision, and the versions of what it runs on, for ``indexer_build_info``.
The start line, ``--version``, ``indexer_build_info`` and ``GetWarmupStatusResponse.server_version`` all read
:data:`VERSION` and :data:`BUILD`.

The commit is :data:`COMMIT_ENV` where the build set it (the image: its ``REVISION`` build argument), else the
checkout's ``HEAD`` where the package runs from a git checkout (``+dirty`` with uncommitted changes), else
``unknown``; the image's revision (its ``org.opencontainers.image.revision`` label) is :data:`IMAGE_REVISION_ENV`,
empty outside an image."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGE = "indexer-service"
# indexer_build_info's labels beside version and python: the distributions whose version changes behaviour or
# speed. Read from metadata, never imported (torch alone takes seconds); "" where one is not installed.
BUILD_DEPENDENCIES = ("grpcio", "protobuf", "numpy", "torch", "triton")


def _installed(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return ""


# "unknown" when run from a tree that was never installed (no metadata).
VERSION = _installed(PACKAGE) or "unknown"
COMMIT_ENV = "INDEXER_BUILD_COMMIT"
IMAGE_REVISION_ENV = "INDEXER_IMAGE_REVISION"


def _checkout_commit(where: Path) -> str:
    """``HEAD`` of the git checkout ``where`` lies in, 12 hex digits, ``+dirty`` with uncommitted changes to
    tracked files; "" outside a checkout or without git."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return ""
    return commit + ("+dirty" if dirty else "")


@functools.cache
def build() -> dict[str, str]:
    """``{"version", "commit", "image_revision"}`` of this server (read once: a git call at most)."""
    commit = os.environ.get(COMMIT_ENV) or _checkout_commit(Path(__file__).resolve().parent) or "unknown"
    return {"version": VERSION, "commit": commit, "image_revision": os.environ.get(IMAGE_REVISION_ENV, "")}


def version_line() -> str:
    """``VERSION (commit C[, image R])``: what ``--version`` prints and GetWarmupStatus's ``server_version`` says."""
    info = build()
    image = f", image {info['image_revision']}" if info["image_revision"] else ""
    return f"{VERSION} (commit {info['commit']}{image})"


@functools.cache
def build_labels() -> dict[str, str]:
    """indexer_build_info's labels: one fixed set of names, one value each per build. Read once per process (five
    metadata look-ups, milliseconds: a server's metrics ask for the names and then the values)."""
    return {
        **build(),
        "python": platform.python_version(),
        **{name: _installed(name) for name in BUILD_DEPENDENCIES},
    }
