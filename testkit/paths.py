"""Where the repository lies, for tests and benchmarks alike: one constant, whatever folder its user sits in."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The product's source folders (pyproject's packages): what ships, as against tests, testkit and benchmarks.
PRODUCT_FOLDERS = ("service", "kernels", "protos", "clients/python/client")

# A repository path cited in a text: a top-level entry of the repository, then more path; placeholders (<x>, *,
# $VAR, ...) are not paths. A sentence's full stop after it is not part of it.
_TOP_LEVEL = sorted(p.name for p in REPO.iterdir() if not p.name.startswith("."))
_CITED_PATH = re.compile(
    r"(?<![\w./$-])(?:\.\./)?((?:" + "|".join(map(re.escape, _TOP_LEVEL)) + r")(?:/[\w.-]+)*/?)(?![\w<*$/-]|\.\w)"
)


# A path at a commit (``git show 1b40193:benchmarks/results/x.json``, a file since removed) is not one of the tree's.
_AT_COMMIT = re.compile(r"\b[0-9a-f]{7,40}:$")


def cited_paths(text: str) -> list[str]:
    """The repository paths ``text`` cites (``service/compute/fastpath.c``, ``tests/kernels/``), in order; a path
    after a commit and a colon (``git show <commit>:<path>``) is that commit's, not the tree's, and is left out."""
    return [
        match.group(1).rstrip(".")
        for match in _CITED_PATH.finditer(text)
        if not _AT_COMMIT.search(text, 0, match.start(1))
    ]


def cited_path_exists(path: str, citing: Path) -> bool:
    """Whether a cited path exists, from the repository's root or the citing file's folder; a module named without
    its suffix (``service/compute/_fastpath``, the compiled extension) counts."""
    return any(
        (base / path).exists() or any((base / path).parent.glob(f"{Path(path).name}.*"))
        for base in (REPO, citing.parent)
    )
