"""Every repository path the code and the documents cite exists (issue 22 item 3): comments, docstrings and prose
name files that a reader can open. A moved or renamed file leaves no stale citation behind.

tests/system/test_docs.py checks the code spans and blocks of README.md, docs/*.md and clients/*/README.md with the
same rule (testkit/paths.py); this test reads whole files, code included, and deploy/README.md."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from testkit.paths import REPO, cited_path_exists, cited_paths

# Hand-written sources and documents, by suffix; generated code (protos' *_pb2*.py, clients/python/generated/),
# recorded results (benchmarks/results/) and test data are not read. The Python client is clients/python/client/.
SOURCE_FOLDERS = ("service", "kernels", "testkit", "benchmarks", "tests", "scripts", "clients/python/client")
# The Python client's build and generation scripts, beside its package.
CLIENT_SCRIPTS = ("clients/python/build.py", "clients/python/generate.py")
SOURCE_SUFFIXES = {".py", ".pyi", ".c", ".toml", ".md", ".sh", ".go"}
SKIPPED_FOLDERS = {"results", "data", "__pycache__", "bin"}

# Citations that are intentionally not paths of the repository, each with why.
NOT_PATHS = {
    # Built by `python -m benchmarks.loadgen` (git-ignored): the load generator's binary, named where it is made.
    "benchmarks/loadgen/bin/loadgen",
    "benchmarks/loadgen/bin/",
    # Built by `python -m benchmarks.goecho` (git-ignored): bench_rpc's grpc-go echo, named where it is made.
    "benchmarks/goecho/bin/goecho",
    "benchmarks/goecho/bin/",
    # kubectl's resource/name syntax (`rollout status deploy/indexer`): the Deployment, not a folder.
    "deploy/indexer",
}


# Made by scripts/install-client-tools.sh (`npm ci`; git-ignored), so absent from a clone until it runs, `make test`
# or not: a citation under a node_modules/ folder holds if that script fills that folder from its package-lock.json.
INSTALL_CLIENT_TOOLS = REPO / "scripts" / "install-client-tools.sh"


def installed_by_npm(cited: str) -> bool:
    parts = cited.split("/")
    if "node_modules" not in parts:
        return False
    package = "/".join(parts[: parts.index("node_modules")])
    script = INSTALL_CLIENT_TOOLS.read_text()
    return (REPO / package / "package-lock.json").is_file() and f'npm ci --prefix "$ROOT/{package}"' in script


def citing_files() -> Iterator[Path]:
    for folder in SOURCE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*")):
            skipped = SKIPPED_FOLDERS.intersection(path.relative_to(REPO).parts)
            if path.is_file() and path.suffix in SOURCE_SUFFIXES and not skipped:
                yield path
    yield from (path for path in sorted((REPO / "protos").rglob("*.py")) if "_pb2" not in path.name)
    yield from (REPO / script for script in CLIENT_SCRIPTS)
    yield from sorted((REPO / "docs").glob("*.md"))
    yield REPO / "README.md"
    yield REPO / "deploy" / "README.md"
    yield from sorted(REPO.glob("clients/*/README.md"))


def test_the_scan_reads_code_and_documents() -> None:
    """Not vacuous: the scan reads this file, the fast path's C source, the Python client and its build script and
    the deploy guide, and finds citations."""
    read = set(citing_files())
    assert {
        Path(__file__),
        REPO / "service" / "compute" / "fastpath.c",
        REPO / "clients" / "python" / "client" / "__init__.py",
        REPO / "clients" / "python" / "build.py",
        REPO / "deploy" / "README.md",
    } <= read
    assert "testkit/paths.py" in cited_paths((Path(__file__)).read_text())


def test_every_cited_repository_path_exists() -> None:
    stale = [
        f"{path.relative_to(REPO)}:{number}: {cited}"
        for path in citing_files()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        for cited in cited_paths(line)
        if cited not in NOT_PATHS and not installed_by_npm(cited) and not cited_path_exists(cited, path)
    ]
    assert not stale, "citations of paths that do not exist:\n" + "\n".join(stale)


def test_paths_npm_installs_count_whether_installed_or_not() -> None:
    """The Node client's and buf's modules are cited; they count as paths by the install script's word, not by the
    disk's, so the test above passes in a clone where scripts/install-client-tools.sh has not run; a folder the
    script does not fill, or outside any npm package of the repository, does not count."""
    assert "clients/node/node_modules" in {c for p in citing_files() for c in cited_paths(p.read_text())}
    assert installed_by_npm("clients/node/node_modules") and installed_by_npm("tools/buf/node_modules/.bin/buf")
    elsewhere = ("clients", "go", "node_modules"), ("clients", "node", "lib")  # (not written as citations)
    assert not any(installed_by_npm("/".join(parts)) for parts in elsewhere)


def test_every_allowed_non_path_is_still_cited() -> None:
    """An allow-list entry nothing cites any more is dead: remove it."""
    cited = {c for path in citing_files() for c in cited_paths(path.read_text(errors="replace"))}
    assert cited >= NOT_PATHS, sorted(NOT_PATHS - cited)
