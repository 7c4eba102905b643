"""Fixtures of the service layer."""

from __future__ import annotations

import pytest

from indexer_service.service.dataplane import DataPlane
from testkit.planes import make_plane


@pytest.fixture
def plane() -> DataPlane:
    """A data plane for one test: the numpy backend, no warmup keys and no warmup (run, so it is over), the
    default settings otherwise."""
    plane = make_plane(backend="numpy", keys=(), warmup_target="none")
    plane.warmup.run()
    return plane
