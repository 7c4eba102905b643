"""Helpers for the deploy tests: rendering kustomizations, reading the Dockerfile, PromQL in rules and dashboard.

Everything here drives the real tools (kustomize, promtool, prometheus, hadolint, the service's CLI); the parsing
is only as deep as the checks need.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKERFILE = ROOT / "Dockerfile"
RULES_FILE = DEPLOY / "prometheus" / "indexer.rules.yml"
RULE_TESTS = sorted((DEPLOY / "prometheus" / "tests").glob("*.yml"))
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "indexer-dashboard.json"
INSTALL_HINT = "run scripts/install-deploy-tools.sh"

# Every directory holding a kustomization is rendered and validated, so a new overlay is tested unasked.
KUSTOMIZATIONS = sorted(p.parent.relative_to(ROOT).as_posix() for p in DEPLOY.rglob("kustomization.yaml"))


def find_tool(name: str) -> str | None:
    """A tool on PATH, or in the venv running the tests (where the setup script may put kubectl)."""
    venv_tool = Path(sys.executable).parent / name
    return shutil.which(name) or (str(venv_tool) if venv_tool.is_file() else None)


def kustomize_command() -> list[str] | None:
    if tool := find_tool("kustomize"):
        return [tool, "build"]
    if tool := find_tool("kubectl"):
        return [tool, "kustomize"]
    return None


@functools.cache
def render(kustomization: str) -> tuple[dict, ...]:
    """The objects `kustomize build` emits for a directory under the repo root."""
    command = kustomize_command()
    if command is None:
        raise RuntimeError(f"neither kustomize nor kubectl found: {INSTALL_HINT}")
    out = subprocess.run([*command, str(ROOT / kustomization)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise AssertionError(f"kustomize failed on {kustomization}:\n{out.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def one(objects: tuple[dict, ...], kind: str, name_prefix: str = "") -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].startswith(name_prefix)]
    assert len(found) == 1, f"expected one {kind} {name_prefix!r}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def container(deployment: dict, name: str = "indexer") -> dict:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def container_port(c: dict, name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


def prestop_sleep_seconds(c: dict) -> int:
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, f"preStop is not a plain sleep: {command}"
    return int(command[1])


# --- Dockerfile ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    stage: int  # index of the FROM it belongs to; -1 before the first FROM


def dockerfile_instructions(text: str | None = None) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped."""
    text = DOCKERFILE.read_text() if text is None else text
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stage = -1
    result = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        if keyword.upper() == "FROM":
            stage += 1
        result.append(Instruction(keyword.upper(), args.strip(), stage))
    return result


def dockerfile_arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    defaults = {}
    for ins in instructions:
        if ins.keyword == "ARG" and "=" in ins.args:
            name, _, value = ins.args.partition("=")
            defaults[name] = value.strip('"')
    return defaults


def substitute(text: str, variables: dict[str, str]) -> str:
    """Docker's ${VAR}, ${VAR:-default} and $VAR, with unknown variables left as they are."""

    def one_var(match: re.Match) -> str:
        name, default = match.group("name") or match.group("bare"), match.group("default")
        if name in variables:
            return variables[name]
        return default if default is not None else match.group(0)

    return re.sub(r"\$\{(?P<name>\w+)(?::-(?P<default>[^}]*))?\}|\$(?P<bare>\w+)", one_var, text)


def dockerfile_env(instructions: list[Instruction]) -> dict[str, str]:
    env = {}
    for ins in instructions:
        if ins.keyword == "ENV":
            for token in shlex.split(ins.args):
                name, _, value = token.partition("=")
                env[name] = value
    return env


def exec_form(args: str) -> list[str]:
    """CMD/ENTRYPOINT/HEALTHCHECK CMD in JSON (exec) form."""
    parsed = json.loads(args)
    assert isinstance(parsed, list), f"not exec form: {args}"
    return parsed


def pip_install_commands(text: str) -> list[list[str]]:
    """Every `pip install ...` in a text (Dockerfile RUN lines, Makefile recipes, README code), as argv tails."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        for part in re.split(r"&&|;|\|\|", line):
            match = re.search(r"\bpip3? install\b(.*)", part)
            if match:
                commands.append(shlex.split(match.group(1).replace("$(", "_(")))
    return commands


def requirement_args(argv: list[str]) -> list[str]:
    """The requirement specifiers of a pip install argv: options and their values dropped."""
    takes_value = {"--index-url", "-i", "--extra-index-url", "-f", "--find-links", "-c", "--constraint", "-r"}
    result, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token in takes_value:
            skip = True
        elif not token.startswith("-"):
            result.append(token)
    return result


# --- .dockerignore ------------------------------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern:
    # Docker matches with Go's filepath.Match plus `**`: `*` stays within one path segment.
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def docker_context_files(root: Path = ROOT) -> list[str]:
    """Files `docker build` would send from ``root`` under its .dockerignore (last matching pattern wins, and a
    pattern matching a directory covers everything below it)."""
    rules = []
    for line in (root / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        rules.append((negate, _pattern_regex(pattern.strip("/"))))

    def excluded(rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        verdict = False
        for negate, regex in rules:
            if any(regex.match(p) for p in prefixes):
                verdict = not negate
        return verdict

    files = []
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(".git/") or rel.startswith(".venv/"):
            continue  # both are excluded by the allow-list; skipping them keeps the walk fast
        if path.is_file() and not excluded(rel):
            files.append(rel)
    return sorted(files)


# --- PromQL in rules and dashboard --------------------------------------------------------------------------

# The values Grafana substitutes; in the live test, a window that holds several 1 s scrapes.
GRAFANA_TEST_VALUES = {"job": ".*", "instance": ".*", "__rate_interval": "20s", "__range": "5m"}


def alert_rules() -> list[dict]:
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_targets() -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel."""
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def expand_grafana(expr: str) -> str:
    expanded = substitute(expr, GRAFANA_TEST_VALUES)
    assert "$" not in expanded, f"unknown Grafana variable left in {expanded!r}"
    return expanded


def metric_names(expr: str) -> set[str]:
    """Sample names a PromQL expression reads (every metric of the service starts with indexer_)."""
    return set(re.findall(r"\bindexer_[a-zA-Z0-9_]+", expr))


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports; all are held until every one is chosen, so none repeats."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def service_defaults() -> dict:
    """The server's embedded default configuration (the file `indexer-service serve` starts from)."""
    return tomllib.loads((ROOT / "service" / "default_config.toml").read_text())


def server_shutdown_seconds(env: dict[str, str]) -> float:
    """Seconds from SIGTERM to exit at the latest: the delay before refusing calls plus the drain grace, each
    from the pod's INDEXER_* environment where set, else the server's default."""
    defaults = service_defaults()
    return sum(
        float(env.get(f"INDEXER_{key.upper()}", defaults[key]))
        for key in ("shutdown_delay_seconds", "shutdown_grace_seconds")
    )
