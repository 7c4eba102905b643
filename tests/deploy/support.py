"""Helpers for the deploy tests: rendering kustomizations, reading the Dockerfile, PromQL in rules and dashboard.

Everything here drives the real tools (kustomize, promtool, prometheus, hadolint, the service's CLI); the parsing
is only as deep as the checks need.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import yaml
from packaging.utils import canonicalize_name
from packaging.version import Version
from prometheus_client.parser import text_string_to_metric_families

from testkit.harness import poll
from testkit.paths import REPO

ROOT = REPO
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


def stage_named(instructions: list[Instruction], name: str) -> list[Instruction]:
    """The instructions of the stage ``FROM ... AS name``."""
    (index,) = {i.stage for i in instructions if i.keyword == "FROM" and i.args.lower().endswith(f" as {name}")}
    return [i for i in instructions if i.stage == index]


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
    """Every `pip install ...` in a text (Dockerfile RUN lines, Makefile recipes, README code and prose), as
    argv tails; a command ends at a shell separator, a comment or a closing backtick."""
    text = text.replace("\\\n", " ")
    return [shlex.split(m.group(1)) for m in re.finditer(r"\bpip3? install\b([^#`;&|\n]*)", text)]


def requirement_args(argv: list[str]) -> list[str]:
    """The requirement specifiers of a pip install argv: options and their values dropped."""
    takes_value = {
        "--index-url",
        "-i",
        "--extra-index-url",
        "-f",
        "--find-links",
        "-c",
        "--constraint",
        "-r",
        "--target",
    }
    result, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token in takes_value:
            skip = True
        elif not token.startswith("-"):
            result.append(token)
    return result


LOCKS = {"cpu": ROOT / "requirements" / "image-cpu.txt", "gpu": ROOT / "requirements" / "image-gpu.txt"}


@dataclass(frozen=True)
class Lock:
    """A hashed requirements file as scripts/lock-image-deps.py writes it."""

    options: tuple[str, ...]  # option lines, e.g. "--find-links URL"
    pins: dict[str, Version]  # canonical name -> the exact version
    hashes: dict[str, tuple[str, ...]]  # canonical name -> its sha256 hashes


def read_lock(path: Path) -> Lock:
    options, pins, hashes = [], {}, {}
    for line in path.read_text().replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            options.append(line)
            continue
        requirement, *tail = line.split()
        name, _, version = requirement.partition("==")
        assert version and all(t.startswith("--hash=") for t in tail), f"{path.name}: not an exact, hashed pin: {line}"
        pins[canonicalize_name(name)] = Version(version)
        hashes[canonicalize_name(name)] = tuple(t.removeprefix("--hash=") for t in tail)
    return Lock(tuple(options), pins, hashes)


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
GRAFANA_TEST_VALUES = {
    "cluster": ".*",
    "namespace": ".*",
    "job": ".*",
    "instance": ".*",
    "__rate_interval": "20s",
    "__range": "5m",
}


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
    """Sample names a PromQL expression reads: the service's own (indexer_...) and its processes' (process_...)."""
    return set(re.findall(r"\b(?:indexer|process)_[a-zA-Z0-9_]+", expr))


def markdown_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (lower case, punctuation but `-` and `_` dropped,
    spaces to `-`, a repeat suffixed -1, -2...); headings inside code fences are none."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


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
    return tomllib.loads((ROOT / "service" / "config" / "default_config.toml").read_text())


def server_shutdown_seconds(env: dict[str, str]) -> float:
    """Seconds from SIGTERM to exit at the latest: the delay before refusing calls plus the drain grace, each
    from the pod's INDEXER_* environment where set, else the server's default."""
    defaults = service_defaults()
    return sum(
        float(env.get(f"INDEXER_{key.upper()}", defaults[key]))
        for key in ("shutdown_delay_seconds", "shutdown_grace_seconds")
    )


# --- processes ----------------------------------------------------------------------------------------------


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1, process: subprocess.Popen | None = None):
    """:func:`testkit.harness.poll` on a predicate that may fail while a service starts (connection refused, a
    half-written file): such errors count as "not yet"; fails with ``what`` after ``timeout`` seconds or as
    soon as ``process`` has exited."""
    last_error: list[Exception] = []

    def attempt():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"{what}: process exited with {process.returncode}")
        try:
            return predicate()
        except (OSError, urllib.error.URLError, ValueError) as exc:
            last_error[:] = [exc]
            return None

    if result := poll(attempt, timeout, interval):
        return result
    raise AssertionError(f"{what}: not within {timeout} s (last error: {last_error[0] if last_error else None})")


class LoggedProcess:
    """A child process whose output goes to a file (a pipe nobody reads would block it), stopped for sure."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()
        return self.process.returncode


class Prometheus:
    """A real Prometheus on a free loopback port, with its own storage, scraping ``targets`` every second and
    evaluating the project's rules file, configured from deploy/prometheus/prometheus.yml."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        shipped = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
        static_job = next(job for job in shipped["scrape_configs"] if "static_configs" in job)
        # Only the static job: the DNS job would look up cluster names, and the loopback is all there is here.
        static_job["static_configs"] = [{"targets": targets}]
        static_job["scrape_interval"] = "1s"
        config = {
            "global": {**shipped["global"], "scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str((PROMETHEUS_CONFIG.parent / f).resolve()) for f in shipped["rule_files"]],
            "scrape_configs": [static_job],
        }
        self.job = static_job["job_name"]
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = LoggedProcess(
            [
                find_tool("prometheus") or "prometheus",
                f"--config.file={config_path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            workdir / "prometheus.log",
        )
        wait_for(lambda: http_get(f"{self.url}/-/ready")[0] == 200, 60, "prometheus ready", process=self.proc.process)

    def api(self, path: str, **params: str) -> dict:
        status, body = http_get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}")
        reply = json.loads(body)
        assert status == 200 and reply["status"] == "success", f"{path} {params}: {reply}"
        return reply["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def stop(self) -> None:
        self.proc.stop()


# --- the service, as the image and the pod run it -----------------------------------------------------------

VENV_BIN = Path(sys.executable).parent
# The three kinds of call a scheduler makes, and a caller's mistake (INVALID_ARGUMENT), so that every
# label combination the alerts and the dashboard read gets a series.
QSL, SEQ_LENS, RATIO = np.array([0, 4, 10]), np.array([8, 20]), 4


def base_env(**overrides: str) -> dict[str, str]:
    """The test process's environment without the service's own settings (a developer's INDEXER_* or
    TRITON_CACHE_DIR must not leak into a server under test), the venv first on PATH, then ``overrides``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INDEXER_") and k != "TRITON_CACHE_DIR"}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["INDEXER_WORKERS"] = "1"  # one process unless the caller (the pod's env) says otherwise
    env.update(overrides)
    return env


class Server(LoggedProcess):
    """`indexer-service serve` on 127.0.0.1, its ports chosen by the kernel and read from --port-file; ``http_port``:
    the HTTP port instead (a restarted server where Prometheus scrapes the one before)."""

    def __init__(self, workdir: Path, name: str, argv: list[str] | None = None, http_port: int = 0, **env: str) -> None:
        self.port_file = workdir / f"{name}.ports.json"
        self.port_file.unlink(missing_ok=True)  # a server of the same name before: its ports are not this one's
        argv = [*(argv or ["indexer-service", "serve"]), "--port-file", str(self.port_file)]
        # Loopback only, ports chosen by the kernel: these override whatever the caller's (pod's) env says.
        listen = {"INDEXER_GRPC_HOST": "127.0.0.1", "INDEXER_HTTP_HOST": "127.0.0.1"}
        listen |= {"INDEXER_GRPC_PORT": "0", "INDEXER_HTTP_PORT": str(http_port), "INDEXER_HEALTH_PORT": "0"}
        listen |= {"INDEXER_HTTP_RPC_PORT": "0"}
        env = base_env(**{**env, **listen})
        super().__init__(argv, workdir / f"{name}.log", env)
        self.grpc_port = self.http_port = self.health_port = 0

    def wait_listening(self, timeout: float = 90) -> Server:
        ports = wait_for(
            lambda: self.port_file.exists() and json.loads(self.port_file.read_text()),
            timeout,
            f"{self.log_path.stem} listening",
            process=self.process,
        )
        self.grpc_port, self.http_port, self.health_port = ports["grpc_port"], ports["http_port"], ports["health_port"]
        self.workers = ports.get("workers", 1)  # a supervisor's port file says how many; one process writes none
        return self

    def wait_ready(self, timeout: float = 120) -> Server:
        if not self.grpc_port:
            self.wait_listening(timeout)
        wait_for(lambda: self.http("/readyz")[0] == 200, timeout, f"{self.log_path.stem} ready", process=self.process)
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def http(self, path: str) -> tuple[int, bytes]:
        return http_get(f"http://127.0.0.1:{self.http_port}{path}")

    def samples(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """The /metrics scrape, sample name -> [(labels, value)], through prometheus_client's own parser."""
        status, body = self.http("/metrics")
        assert status == 200
        result: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                result.setdefault(sample.name, []).append((sample.labels, sample.value))
        return result

    def calls(self, method: str = "BuildChunk", code: str = "OK") -> float:
        """How many ``method`` calls this server answered with ``code``: how the tests tell replicas apart."""
        return sum(
            value
            for labels, value in self.samples().get("indexer_request_duration_seconds_count", [])
            if labels["method"] == method and labels["code"] == code
        )


# A PlanBatch of 1,000 one-query chunks (omitting token_to_seq): about 0.2 s of server CPU on this project's host,
# ten times EXPIRING_DEADLINE, so it starts and expires while served: DEADLINE_EXCEEDED in indexer_request_errors_total.
EXPIRING_DEADLINE = 0.02
# A compress ratio outside the pod's warmup set (1, 4, 128): every such request is a warmup miss.
MISSED_RATIO = 8


def send_expiring_call(client) -> None:
    """One call the server starts and that expires while served (the caller sees DEADLINE_EXCEEDED)."""
    from indexer_service.kernels.planner import BatchInputs

    slow = BatchInputs(np.array([0, 1000]), np.array([2**16]), RATIO, 0, 2**20, max_logits_bytes=4)
    try:
        client.plan_batch(slow, omit_token_to_seq=True, timeout=EXPIRING_DEADLINE)
    except grpc.RpcError as exc:
        assert exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED, exc
    else:
        raise AssertionError(f"a 0.2 s PlanBatch finished within {EXPIRING_DEADLINE} s")


def send_expired_call(client) -> None:
    """A caller's 1 us deadline: the server sheds it (mostly deadline_on_arrival), or it never reaches the server."""
    from indexer_service.kernels.inputs import ChunkInputs

    try:
        client.build_chunk(ChunkInputs(QSL, SEQ_LENS, RATIO, 0, 2), timeout=1e-6)
    except grpc.RpcError as exc:
        assert exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED, exc


def send_warmup_miss(client, ratio: int = MISSED_RATIO) -> None:
    """A BuildChunk at a compress ratio outside the warmup set: served, and counted as a warmup miss."""
    from indexer_service.kernels.inputs import ChunkInputs

    assert client.build_chunk(ChunkInputs(QSL, SEQ_LENS, ratio, 0, 2)) is not None


def send_traffic(client, rounds: int) -> None:
    """``rounds`` x (BuildChunk, PlanBatch, one INVALID_ARGUMENT) through an IndexerClient."""
    from indexer_service.kernels.inputs import ChunkInputs
    from indexer_service.kernels.planner import BatchInputs

    for _ in range(rounds):
        meta = client.build_chunk(ChunkInputs(QSL, SEQ_LENS, RATIO, 0, 2))
        assert meta is not None and meta.cu_seq_lens.tolist() == [0, 2, 7]
        assert len(client.plan_batch(BatchInputs(QSL, SEQ_LENS, RATIO, 0, 1 << 20)).chunks) == 1
        try:
            client.build_chunk(ChunkInputs(QSL, np.array([2, 20]), RATIO, 0, 2))
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT
        else:
            raise AssertionError("a sequence shorter than its query was accepted")
