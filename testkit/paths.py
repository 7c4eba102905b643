"""Where the repository lies, for tests and benchmarks alike: one constant, whatever folder its user sits in."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
