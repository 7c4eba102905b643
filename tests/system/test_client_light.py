"""The light client distribution (clients/python/build.py) installs alone, in a fresh virtual environment with
nothing of this project, needs no torch or Triton, and calls a real server: the golden cases, a bad request,
health."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.harness import FAST_START, ServiceProcess
from tests.golden import GOLDEN, REPO

BUILD = REPO / "clients" / "python" / "build.py"
# Runs inside the light environment: each golden chunk case through the client, as JSON lines.
SCRIPT = """
import json, sys
import grpc, numpy as np
from indexer_service_client import ChunkInputs, DcpConfig, IndexerClient

address, cases = sys.argv[1], json.loads(sys.stdin.read())
out = {"heavy": sorted(m for m in ("torch", "triton") if m in sys.modules)}
with IndexerClient(address, timeout=20) as client:
    out["health"] = client.health()
    answers = []
    for case in cases:
        spec = case["input"]
        inputs = ChunkInputs(
            np.array(spec["qsl"]), np.array(spec["seq_lens"]), spec["ratio"], spec["start"], spec["end"],
            query_slice=tuple(spec["qslice"]) if "qslice" in spec else None,
            dcp=DcpConfig(spec.get("rank", 0), spec.get("world", 1), spec.get("inter", 1)),
        )
        meta = client.build_chunk(inputs)
        answers.append(None if meta is None else {
            "cu_seqlen_ks": meta.cu_seqlen_ks.tolist(), "cu_seqlen_ke": meta.cu_seqlen_ke.tolist(),
            "token_to_seq": meta.token_to_seq.tolist(), "total_seq_lens": meta.total_seq_lens,
        })
    out["answers"] = answers
    try:
        client.build_chunk(ChunkInputs(np.array([0, 5, 3]), np.array([5, 5]), 4, 0, 2))
    except grpc.RpcError as exc:
        out["bad"] = [exc.code().name, exc.details()]
print(json.dumps(out))
"""


# The build must work with whatever python3 a machine has, not only this project's virtual environment: the
# system's (Debian 12: 3.11 with setuptools 65.5, which refused the old setuptools build's license field).
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable


def build_wheel(out: Path) -> Path:
    built = subprocess.run([SYSTEM_PYTHON, str(BUILD), str(out)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stdout + built.stderr
    return Path(built.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def light_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with only the client wheel (built by the system's python3) and what its
    metadata asks for."""
    folder = tmp_path_factory.mktemp("client-light")
    wheel = build_wheel(folder / "dist")
    venv.create(folder / "venv", with_pip=True)
    python = folder / "venv" / "bin" / "python"
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return python


@pytest.fixture(scope="module")
def server() -> Iterator[ServiceProcess]:
    with ServiceProcess(*FAST_START) as process:
        yield process


def test_the_light_environment_has_no_torch_triton_or_server(light_python: Path) -> None:
    listed = subprocess.run(
        [str(light_python), "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True
    )
    names = {package["name"].lower() for package in json.loads(listed.stdout)}
    assert "indexer-service-client" in names
    assert not names & {"torch", "triton", "indexer-service"}, names
    # What the four dependencies bring (grpcio needs typing_extensions), and the venv's own pip.
    allowed = {
        "indexer-service-client",
        "numpy",
        "grpcio",
        "grpcio-health-checking",
        "protobuf",
        "typing-extensions",
        "typing_extensions",
        "pip",
        "setuptools",
    }
    assert names <= allowed, names


def test_the_light_client_answers_the_golden_cases(light_python: Path, server: ServiceProcess) -> None:
    cases = GOLDEN["chunk_metadata"]
    ran = subprocess.run(
        [str(light_python), "-c", SCRIPT, server.address],
        input=json.dumps(cases),
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
    code, details = out["bad"]
    assert code == "INVALID_ARGUMENT" and details.startswith("query_start_loc")


def test_the_wheel_is_the_same_bytes_from_the_same_sources(tmp_path: Path) -> None:
    first, second = build_wheel(tmp_path / "a"), build_wheel(tmp_path / "b")
    assert first.name == second.name and first.name.endswith("-py3-none-any.whl")
    assert first.read_bytes() == second.read_bytes()
