"""The light client distribution (clients/python/build.py) installs alone, in a fresh virtual environment with
nothing of this project, needs no torch or Triton, and calls a real server: the golden cases, a batch plan, the
warmup status, a bad request, health. At both ends of the range its metadata declares: the lowest version of every
dependency (grpcio, grpcio-health-checking, protobuf, numpy), and the newest the package index has."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import inspect
import json
import shutil
import subprocess
import sys
import tomllib
import venv
from collections.abc import Iterator
from dataclasses import fields
from importlib import metadata
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from indexer_service.client import IndexerClient
from indexer_service.kernels.planner import BatchInputs, PrefillPlan
from indexer_service.protos.indexer.v1 import indexer_pb2
from testkit.harness import FAST_START, ServiceProcess
from tests.golden import GOLDEN, REPO

BUILD = REPO / "clients" / "python" / "build.py"
METADATA = REPO / "clients" / "python" / "metadata.toml"
# The wheels the light environments install, kept between runs (git ignores .cache/): an end whose files are all
# here installs without the index; the newest end asks the index what is newest, and downloads only what is new.
WHEEL_CACHE = REPO / ".cache" / "client-light-wheels"
ENDS = ("lowest", "newest")
# A batch of a decode and three prefill requests whose plan has three chunks, one of them a query slice.
BATCH = {"qsl": [0, 1, 4, 9, 17], "seq_lens": [20, 10, 5, 40], "ratio": 4, "decodes": 1, "max_len": 64, "logits": 160}


def plan_json(plan: PrefillPlan) -> dict:
    """A plan as JSON values (runs in the light environment too: the script below holds its source)."""

    def plain(value: object) -> object:
        return value.tolist() if hasattr(value, "tolist") else value  # numpy arrays and scalars

    return json.loads(
        json.dumps(
            {
                "chunks": [[c.req_start, c.req_end, c.query_start, c.query_stop] for c in plan.chunks],
                "metadata": [{f.name: plain(getattr(m, f.name)) for f in fields(m)} for m in plan.metadata],
                "max_prefill_seq_len": plan.max_prefill_seq_len,
            }
        )
    )


def warmup_json(status: indexer_pb2.GetWarmupStatusResponse, pb: ModuleType) -> dict:
    """A GetWarmupStatusResponse as JSON values, its enums by name through the generated module ``pb`` (runs in
    the light environment too)."""
    return {
        "state": pb.WarmupState.Name(status.state),
        "skipped": status.state == pb.WARMUP_STATE_SKIPPED,
        "ready": status.ready,
        "backend": status.backend,
        "target": status.target,
        "server_version": status.server_version,
        "keys": [[key.label, pb.KeyState.Name(key.state)] for key in status.keys],
        "fallbacks": [[f.library, f.feature] for f in status.dependency_fallbacks],
    }


# Runs inside the light environment with warnings as errors: versions, health, warmup status, each golden chunk
# case, a batch plan and a bad request (with a request id of its own) through the client, with its settings beyond
# the defaults (metadata, the reconnect backoff), as one JSON object.
SCRIPT = f"""from __future__ import annotations
import json, sys
from dataclasses import fields
from importlib import metadata
import grpc, numpy as np
from indexer_service_client import BatchInputs, ChunkInputs, DcpConfig, IndexerClient
from indexer_service_client.protos.indexer.v1 import indexer_pb2

{inspect.getsource(plan_json)}
{inspect.getsource(warmup_json)}
address, request = sys.argv[1], json.loads(sys.stdin.read())
out = {{"heavy": sorted(m for m in ("torch", "triton", "indexer_service") if m in sys.modules)}}
out["versions"] = {{n: metadata.version(n) for n in ("grpcio", "grpcio-health-checking", "protobuf", "numpy")}}
with IndexerClient(address, timeout=20, max_reconnect_backoff_seconds=5.0, metadata=[("x-tenant", "light")]) as client:
    out["health"] = client.health()
    out["warmup"] = warmup_json(client.warmup_status(), indexer_pb2)
    answers = []
    for case in request["cases"]:
        spec = case["input"]
        inputs = ChunkInputs(
            np.array(spec["qsl"]), np.array(spec["seq_lens"]), spec["ratio"], spec["start"], spec["end"],
            query_slice=tuple(spec["qslice"]) if "qslice" in spec else None,
            dcp=DcpConfig(spec.get("rank", 0), spec.get("world", 1), spec.get("inter", 1)),
        )
        meta = client.build_chunk(inputs)
        answers.append(None if meta is None else {{
            "cu_seqlen_ks": meta.cu_seqlen_ks.tolist(), "cu_seqlen_ke": meta.cu_seqlen_ke.tolist(),
            "token_to_seq": meta.token_to_seq.tolist(), "total_seq_lens": meta.total_seq_lens,
        }})
    out["answers"] = answers
    b = request["batch"]
    batch = BatchInputs(np.array(b["qsl"]), np.array(b["seq_lens"]), b["ratio"], num_decodes=b["decodes"],
                        max_model_len=b["max_len"], max_logits_bytes=b["logits"])
    out["plan"] = plan_json(client.plan_batch(batch))
    try:
        client.build_chunk(ChunkInputs(np.array([0, 5, 3]), np.array([5, 5]), 4, 0, 2),
                           metadata=[("x-request-id", "light-bad-1")])
    except grpc.RpcError as exc:
        ids = [m.value for m in exc.trailing_metadata() if m.key == "x-request-id"]
        out["bad"] = [exc.code().name, exc.details(), ids]
print(json.dumps(out))
"""


# The build must work with whatever python3 a machine has, not only this project's virtual environment: the
# system's (Debian 12: 3.11 with setuptools 65.5, which refused the old setuptools build's license field).
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable


def build_wheel(out: Path) -> Path:
    built = subprocess.run([SYSTEM_PYTHON, str(BUILD), str(out)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stdout + built.stderr
    return Path(built.stdout.strip().splitlines()[-1])


def declared() -> list[Requirement]:
    """The wheel's dependencies, as clients/python/metadata.toml declares them."""
    return [Requirement(r) for r in tomllib.loads(METADATA.read_text())["project"]["dependencies"]]


def lower_bounds() -> dict[str, Version]:
    """Each dependency's lowest allowed version (its ``>=`` bound)."""
    bounds = {}
    for requirement in declared():
        (lower,) = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
        bounds[requirement.name] = lower
    return bounds


@contextlib.contextmanager
def _cache_lock() -> Iterator[None]:
    """One pip at a time writes to the wheel cache (two runs of this module may share the repository)."""
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    with (WHEEL_CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # This environment's pip installs into the light one (--python): the light one holds no pip of its own.
    command = [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def install(python: Path, wheel: Path, end: str) -> None:
    """Install ``wheel`` into the environment of ``python`` at ``end`` of its declared range, from the cache."""
    offline = ["install", "-q", "--no-index", "--find-links", str(WHEEL_CACHE), str(wheel)]
    with _cache_lock():
        if end == "lowest":
            pins = [f"{name}=={version}" for name, version in lower_bounds().items()]
            if _pip(python, *offline, *pins).returncode == 0:
                return
            fetch = pins
        else:
            fetch = [str(r) for r in declared()]
        downloaded = _pip(python, "download", "-q", "--only-binary", ":all:", "-d", str(WHEEL_CACHE), *fetch)
        assert downloaded.returncode == 0, downloaded.stdout + downloaded.stderr
        installed = _pip(python, *offline, *(fetch if end == "lowest" else []))
        assert installed.returncode == 0, installed.stdout + installed.stderr


@dataclasses.dataclass(frozen=True)
class LightEnvironment:
    """A light virtual environment: which end of the range it holds, and its interpreter."""

    end: str
    python: Path


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The client wheel, built by the system's python3."""
    return build_wheel(tmp_path_factory.mktemp("client-light-dist"))


@pytest.fixture(scope="module", params=ENDS)
def light(request: pytest.FixtureRequest, wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> LightEnvironment:
    """A fresh virtual environment with only the client wheel and what its metadata asks for, at the lowest
    versions it allows or at the newest."""
    folder = tmp_path_factory.mktemp(f"client-light-{request.param}")
    venv.create(folder, with_pip=False)
    python = folder / "bin" / "python"
    install(python, wheel, request.param)
    return LightEnvironment(request.param, python)


@pytest.fixture(scope="module")
def server() -> Iterator[ServiceProcess]:
    with ServiceProcess(*FAST_START) as process:
        yield process


@pytest.mark.slow  # a virtual environment per end of the range
def test_the_light_environment_holds_only_the_client_and_its_range(light: LightEnvironment) -> None:
    listed = _pip(light.python, "list", "--format=json")
    assert listed.returncode == 0, listed.stderr
    versions = {package["name"].lower().replace("_", "-"): package["version"] for package in json.loads(listed.stdout)}
    assert "indexer-service-client" in versions
    assert not versions.keys() & {"torch", "triton", "indexer-service"}, versions
    # What the four dependencies bring (newer grpcio needs typing_extensions), and nothing else: not even pip.
    allowed = {"indexer-service-client", "numpy", "grpcio", "grpcio-health-checking", "protobuf", "typing-extensions"}
    assert versions.keys() <= allowed, versions
    for name, lower in lower_bounds().items():
        installed = Version(versions[name])
        if light.end == "lowest":
            assert installed == lower, (name, installed)
        else:  # at least what the server's own environment resolved, the newest when it was installed
            assert installed >= Version(metadata.version(name)), (name, installed)


@pytest.mark.slow
def test_the_light_client_answers_a_live_server(light: LightEnvironment, server: ServiceProcess) -> None:
    cases = GOLDEN["chunk_metadata"]
    ran = subprocess.run(
        [str(light.python), "-W", "error", "-c", SCRIPT, server.address],
        input=json.dumps({"cases": cases, "batch": BATCH}),
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert ran.returncode == 0, ran.stderr
    out = json.loads(ran.stdout)
    assert out["heavy"] == [] and out["health"] == "SERVING"
    for case, answer in zip(cases, out["answers"], strict=True):
        expected = case["expected"]
        assert answer == (None if expected is None else {k: expected[k] for k in answer}), case["name"]
    code, details, request_ids = out["bad"]
    assert code == "INVALID_ARGUMENT" and details.startswith("query_start_loc")
    assert request_ids == ["light-bad-1"]  # the call's metadata went, and came back in the trailers
    # The plan and the warmup status as the server's own client, at the server's versions, reads them.
    batch = BatchInputs(
        np.array(BATCH["qsl"]),
        np.array(BATCH["seq_lens"]),
        BATCH["ratio"],
        num_decodes=BATCH["decodes"],
        max_model_len=BATCH["max_len"],
        max_logits_bytes=BATCH["logits"],
    )
    with IndexerClient(server.address, timeout=20) as client:
        plan, status = client.plan_batch(batch), client.warmup_status()
    assert len(plan.chunks) == 3 and out["plan"] == plan_json(plan)
    assert out["warmup"] == warmup_json(status, indexer_pb2) and out["warmup"]["ready"]
    if light.end == "lowest":
        assert {name: Version(v) for name, v in out["versions"].items()} == lower_bounds()


def test_the_wheel_is_the_same_bytes_from_the_same_sources(tmp_path: Path) -> None:
    first, second = build_wheel(tmp_path / "a"), build_wheel(tmp_path / "b")
    assert first.name == second.name and first.name.endswith("-py3-none-any.whl")
    assert first.read_bytes() == second.read_bytes()
