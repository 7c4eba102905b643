"""Where the repository lies, for tests and benchmarks alike: one constant, whatever folder its user sits in."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# A repository path cited in a text: a top-level entry of the repository, then more path; placeholders (<x>, *,
# $VAR, ...) are not paths. A sentence's full stop after it is not part of it.
_TOP_LEVEL = sorted(p.name for p in REPO.iterdir() if not p.name.startswith("."))
_CITED_PATH = re.compile(
    r"(?<![\w./$-])(?:\.\./)?((?:" + "|".join(map(re.escape, _TOP_LEVEL)) + r")(?:/[\w.-]+)*/?)(?![\w<*$/-]|\.\w)"
)


def cited_paths(text: str) -> list[str]:
    """The repository paths ``text`` cites (``service/compute/fastpath.c``, ``tests/kernels/``), in order."""
    return [path.rstrip(".") for path in _CITED_PATH.findall(text)]


def cited_path_exists(path: str, citing: Path) -> bool:
    """Whether a cited path exists, from the repository's root or the citing file's folder; a module named without
    its suffix (``service/compute/_fastpath``, the compiled extension) counts."""
    return any(
        (base / path).exists() or any((base / path).parent.glob(f"{Path(path).name}.*"))
        for base in (REPO, citing.parent)
    )
