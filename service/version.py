"""The server's version, from the installed package's metadata (pyproject.toml's ``version``, the one source),
and the versions of what it runs on, for ``indexer_build_info``. The start line, ``--version``,
``indexer_build_info`` and ``GetWarmupStatusResponse.server_version`` all read :data:`VERSION`."""

from __future__ import annotations

import functools
import platform
from importlib import metadata

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


@functools.cache
def build_labels() -> dict[str, str]:
    """indexer_build_info's labels: one fixed set of names, one value each per build. Read once per process (five
    metadata look-ups, milliseconds: a server's metrics ask for the names and then the values)."""
    return {
        "version": VERSION,
        "python": platform.python_version(),
        **{name: _installed(name) for name in BUILD_DEPENDENCIES},
    }
