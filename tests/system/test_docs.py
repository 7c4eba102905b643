"""The documents a newcomer reads are true: README.md, docs/*.md and clients/*/README.md.

Every fenced code block carries a marker comment on the line above it:

- ``<!-- doc: run against a server -->``: run as written (bash with the virtual environment's ``bin`` first on the
  PATH, python with its interpreter) against a real server, whose ports are put in for 50051, 50052, 8080 and 8081;
  a ``<!-- doc: output -->`` block right after it is what it must print;
- ``<!-- doc: static -->``: not run, and its first line says so visibly (``# not run by the tests: WHY``); every
  ``indexer-service`` command line in it is parsed by the real command-line parser, every ``make`` target,
  Docker build argument, pip extra and repository path it names exists, and each ``kubectl apply -k`` folder
  renders with kustomize (where kustomize or kubectl is installed, as tests/deploy require);
- docs/clients.md's ``<!-- run|output|file: NAME -->`` blocks: run by tests/system/test_clients_doc.py.

And what the prose cites exists: Python module paths (importable), ``indexer-service`` flags, the ports of the
README's table (each a setting with that default), a default quoted beside a setting's name (that setting's
default), warmup and key state names (the proto's), repository files;
docs/service.md's settings table is the one ``python -m indexer_service.service.config.settings_table`` writes.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.service.config import SETTINGS, embedded_defaults
from indexer_service.service.process.cli import build_parser
from testkit.harness import FAST_START, ServiceProcess
from testkit.paths import cited_path_exists, cited_paths
from tests.deploy.support import kustomize_command, render
from tests.system.clients_support import REPO, VENV_BIN

DOCUMENTS = sorted(
    [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "clients").glob("*/README.md")],
    key=lambda path: str(path),
)
_FENCE = re.compile(r"^(?P<marker><!-- [^\n]* -->\n)?```(?P<lang>[\w-]*)\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)
_DOC_MARKER = re.compile(r"<!-- doc: (run against a server|output|static) -->")
_CLIENTS_DOC_MARKER = re.compile(r"<!-- (run|output|file): [\w./-]+ -->")
STATIC_FIRST_LINE = "# not run by the tests: "


@dataclass(frozen=True)
class Block:
    document: Path
    line: int
    marker: str  # the marker comment's kind ("" when there is none)
    lang: str
    body: str

    def __str__(self) -> str:
        return f"{self.document.relative_to(REPO)}:{self.line}"


def blocks(document: Path) -> list[Block]:
    text = document.read_text()
    found = []
    for match in _FENCE.finditer(text):
        marker = match.group("marker") or ""
        kind = _DOC_MARKER.search(marker) or _CLIENTS_DOC_MARKER.search(marker)
        line = text.count("\n", 0, match.start("lang")) + 1
        found.append(Block(document, line, kind.group(0) if kind else "", match.group("lang"), match.group("body")))
    return found


ALL_BLOCKS = [block for document in DOCUMENTS for block in blocks(document)]


def prose(document: Path) -> str:
    """The document without its code blocks."""
    return _FENCE.sub("", document.read_text())


def code_spans(document: Path) -> list[str]:
    """The inline code of the document's prose (a span may run over a line break, as Markdown allows)."""
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose(document))]


def command_lines(body: str) -> list[str]:
    """The shell command lines of a block, continuations joined, comments dropped."""
    joined = body.replace("\\\n", " ")
    lines = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            lines.append(shlex.join(words))
    return lines


# --- every block is marked, and runs or is checked -----------------------------------------------------------


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=str)
def test_every_block_says_how_it_is_checked(block: Block) -> None:
    assert block.marker, f"{block}: no marker comment above the block (see tests/system/test_docs.py)"
    if block.marker == "<!-- doc: static -->":
        assert block.body.startswith(STATIC_FIRST_LINE), f"{block}: a static block says why on its first line"


STATIC = [block for block in ALL_BLOCKS if block.marker == "<!-- doc: static -->"]


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.MULTILINE))


def subcommand_options() -> dict[str, set[str]]:
    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]  # argparse has no public accessor
    return {name: set(sub._option_string_actions) for name, sub in commands.choices.items()}


@pytest.mark.parametrize("block", STATIC, ids=str)
def test_static_blocks_name_only_what_exists(block: Block) -> None:
    for line in command_lines(block.body):
        words = shlex.split(line)
        if words[0] in ("indexer-service", ".venv/bin/indexer-service"):  # the latter as `make serve` installs it
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    build_parser().parse_args(words[1:])
            except SystemExit as exc:  # --version and --help print and exit 0 once parsed
                if exc.code != 0:
                    pytest.fail(f"{block}: `{line}` does not parse (exit {exc.code})")
        if words[0] == "make":
            assert set(words[1:]) <= make_targets(), f"{block}: `{line}`: no such make target"
        if words[:2] == ["kubectl", "apply"] and "-k" in words:
            folder = words[words.index("-k") + 1]
            assert (REPO / folder / "kustomization.yaml").is_file(), f"{block}: `{line}`: no kustomization there"
            if kustomize_command() is not None:  # where kustomize or kubectl is installed, it renders
                assert any(o["kind"] == "Deployment" for o in render(folder)), f"{block}: `{line}`: no Deployment"
        if words[:2] == ["docker", "build"] and "--build-arg" in words:
            argument = words[words.index("--build-arg") + 1].partition("=")[0]
            assert re.search(rf"^ARG {argument}\b", (REPO / "Dockerfile").read_text(), re.MULTILINE), line
        if words[:2] == ["pip", "install"]:
            extras = re.findall(r"\.\[([\w,-]+)\]", line)
            optional = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
            assert all(set(e.split(",")) <= set(optional) for e in extras), f"{block}: `{line}`: no such extra"
    for path in cited_paths(block.body):
        assert cited_path_exists(path, block.document), f"{block}: {path} does not exist"


# --- blocks run against a real server -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[ServiceProcess]:
    with ServiceProcess(*FAST_START) as process:
        yield process


@pytest.fixture(scope="module")
def light_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The light client's wheel, which a Python path entry imports as is (a pure-Python wheel is a zip)."""
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, str(REPO / "clients" / "python" / "build.py"), str(out)], capture_output=True, text=True
    )
    assert built.returncode == 0, built.stderr
    return Path(built.stdout.split()[-1])


def with_ports(text: str, server: ServiceProcess) -> str:
    return (
        text.replace("127.0.0.1:50051", server.address)
        .replace("127.0.0.1:50052", f"127.0.0.1:{server.health_port}")
        .replace("http://127.0.0.1:8080", server.http_url)
        .replace("http://127.0.0.1:8081", server.http_rpc_url)
    )


RUN = [block for block in ALL_BLOCKS if block.marker == "<!-- doc: run against a server -->"]


def expected_output(block: Block) -> str | None:
    """The ``<!-- doc: output -->`` block that follows ``block`` in its document, if any."""
    following = blocks(block.document)
    at = [b.line for b in following].index(block.line)
    after = following[at + 1] if at + 1 < len(following) else None
    return after.body if after is not None and after.marker == "<!-- doc: output -->" else None


@pytest.mark.parametrize("block", RUN, ids=str)
def test_blocks_run_as_written_against_a_server(
    block: Block, server: ServiceProcess, light_client: Path, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    if block.lang == "python":
        env["PYTHONPATH"] = str(light_client)  # clients/python/README.md imports the light client
        command = [sys.executable, "-c", with_ports(block.body, server)]
    else:
        assert block.lang == "bash", f"{block}: only bash and python blocks run"
        command = ["bash", "-e", "-o", "pipefail", "-c", with_ports(block.body, server)]
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"{block}:\n{run.stdout}{run.stderr}"
    expected = expected_output(block)
    if expected is not None:
        assert run.stdout == expected, str(block)


def test_every_output_block_belongs_to_a_run_block() -> None:
    outputs = [b for b in ALL_BLOCKS if b.marker == "<!-- doc: output -->"]
    assert len(outputs) == sum(expected_output(b) is not None for b in RUN)


# --- what the prose cites exists ------------------------------------------------------------------------------


def test_module_paths_exist() -> None:
    cited = {
        (document.relative_to(REPO), token)
        for document in DOCUMENTS
        for span in code_spans(document)
        for token in re.findall(r"(?<![\w/])(?:indexer_service|service|kernels|protos)\.[A-Za-z_][\w.]*", span)
        if not re.fullmatch(r"\w+\.(md|py|c|h|toml|json|proto)", token)
    }
    assert cited
    for where, token in sorted(cited):
        assert token.startswith("indexer_service."), f"{where}: `{token}` is importable only as indexer_service.{token}"
        parts = token.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                found: object = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            for name in parts[cut:]:
                assert hasattr(found, name), f"{where}: `{token}`: no {name}"
                found = getattr(found, name)
            break
        else:
            pytest.fail(f"{where}: `{token}` does not import")


# Other tools' flags the documents cite: docker's, protoc's (its --go_opt plugin option), curl's client certificate.
OTHER_TOOLS_FLAGS = {"--build-arg", "--decode", "--go_opt", "--cert", "--key"}


def test_flags_exist() -> None:
    options = set().union(*subcommand_options().values())
    cited = {
        (document.relative_to(REPO), span.split()[0].partition("=")[0])
        for document in DOCUMENTS
        for span in code_spans(document)
        if span.startswith("--") and not re.search(r"[<*]", span.split()[0])
    }
    assert cited
    for where, flag in sorted(cited):
        assert flag in options or flag in OTHER_TOOLS_FLAGS, f"{where}: `{flag}` is no indexer-service flag"


README_PORTS = re.findall(r"^\| (\d+) \| `(\w+)` \|", (REPO / "README.md").read_text(), re.MULTILINE)


def test_the_readme_lists_every_port_setting() -> None:
    assert {name for _, name in README_PORTS} >= {name for name in SETTINGS if name.endswith("_port")}


@pytest.mark.parametrize(("port", "setting"), README_PORTS, ids=[s for _, s in README_PORTS])
def test_each_port_of_the_readme_is_the_default_of_its_setting(port: str, setting: str) -> None:
    defaults = embedded_defaults()
    assert setting in defaults, f"README names a port setting that does not exist: {setting}"
    assert defaults[setting] == int(port)


# A setting's name in code with a number in parentheses right after it: "`grpc_max_connections` (2,000)",
# "`malloc_retain_bytes` (256 MiB)", "`shutdown_grace_seconds` (default 10)". The number is the default.
_QUOTED_DEFAULT = re.compile(r"`([a-z_]+)` \((?:default:? )?(\d[\d,]*(?:\.\d+)?)(?: ?(KiB|MiB|GiB|ms|s)\b)?")
_UNIT_SCALE = {None: 1, "s": 1, "ms": 1e-3, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def quoted_defaults() -> list[tuple[str, str, float]]:
    """Each ``(where, setting, value)`` the documents quote beside a setting's name."""
    found = []
    for document in DOCUMENTS:
        for span in re.split(r"\n\s*\n", prose(document)):
            for match in _QUOTED_DEFAULT.finditer(" ".join(span.split())):
                name, number, unit = match.groups()
                if name in SETTINGS:
                    value = float(number.replace(",", "")) * _UNIT_SCALE[unit]
                    found.append((f"{document.relative_to(REPO)}: {match.group(0)}", name, value))
    return found


def test_each_default_quoted_beside_a_setting_is_its_default() -> None:
    defaults = embedded_defaults()
    quoted = quoted_defaults()
    assert len(quoted) >= 20, f"the pattern no longer finds the documents' quoted defaults: {quoted}"
    wrong = [f"{where}: the default is {defaults[name]}" for where, name, value in quoted if value != defaults[name]]
    assert not wrong, "\n".join(wrong)


def test_state_names_are_the_protos() -> None:
    names = set(pb.WarmupState.keys()) | set(pb.KeyState.keys())
    for document in DOCUMENTS:
        for span in code_spans(document):
            for token in re.findall(r"\b(?:WARMUP|KEY)_STATE_[A-Z_]+\b", span):
                assert token in names, f"{document.relative_to(REPO)}: `{token}` is no state of the proto"
            bare = {n.removeprefix("WARMUP_STATE_").removeprefix("KEY_STATE_") for n in names}
            assert span not in bare - {"FAILED"}, (
                f"{document.relative_to(REPO)}: `{span}`: the wire says *_STATE_{span}"
            )


def test_cited_repository_files_exist() -> None:
    for document in DOCUMENTS:
        for span in code_spans(document):
            for path in cited_paths(span):
                assert cited_path_exists(path, document), f"{document.relative_to(REPO)}: `{path}` does not exist"
        for link in re.findall(r"\]\(([^)#:\s]+)(?:#[\w-]*)?\)", prose(document)):
            assert (document.parent / link).exists(), f"{document.relative_to(REPO)}: link {link} goes nowhere"


def test_the_settings_table_is_current() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "indexer_service.service.config.settings_table", "--check"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
