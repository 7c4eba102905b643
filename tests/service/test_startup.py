"""Start-up order against a real server process: listeners first and NOT_SERVING, warmup with progress, then
SERVING and /readyz 200; a failed compile keeps the server not ready (fail closed)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from indexer_service.kernels.specialization import ModelConfig, warmup_keys
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.protos.indexer.v1 import indexer_pb2_grpc as pb_grpc
from indexer_service.service.codec import SERVICE_NAME, encode_int32
from testkit.harness import INDEXER_SERVICE, ServiceProcess, clean_env, http_get
from tests.service.conftest import FAILING_WARMUP, StartServer, scrape

pytestmark = pytest.mark.slow

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DEFAULT_KEY_LABELS = {key.label() for key in warmup_keys(ModelConfig((0, 0, *([4, 128] * 20), 4, 0)))}
E1 = pb.BuildChunkRequest(
    query_start_loc=encode_int32(np.array([0, 1, 4, 9])),
    seq_lens=encode_int32(np.array([20, 10, 5])),
    compress_ratio=4,
    req_start=1,
    req_end=3,
)


def health_statuses(channel: grpc.Channel) -> dict[str, int]:
    stub = health_pb2_grpc.HealthStub(channel)
    return {
        name: stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status for name in ("", SERVICE_NAME)
    }


def test_not_serving_until_warmup_has_compiled_every_key(start_server: StartServer, tmp_path: Path) -> None:
    # A cold Triton cache makes the warmup take seconds: long enough to see every step. The ahead-of-time warmup
    # of a CPU host, on any machine; the Triton backend's in-process warmup is tests/service/test_gpu.py's.
    cold_cache = clean_env(TRITON_CACHE_DIR=str(tmp_path / "cold-cache"))
    server = start_server("--backend", "numpy", ready=False, env=cold_cache)
    with grpc.insecure_channel(server.address) as channel:
        status, body = http_get(f"{server.http_url}/readyz")
        assert (status, body.startswith("warming up")) == (503, True), body
        assert http_get(f"{server.http_url}/livez")[0] == 200
        assert health_statuses(channel) == {"": NOT_SERVING, SERVICE_NAME: NOT_SERVING}
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.PrefillMetadataStub(channel).BuildChunk(E1, timeout=5)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "not ready: warming up" in refused.value.details()
        early = pb_grpc.PrefillMetadataStub(channel).GetWarmupStatus(pb.GetWarmupStatusRequest(), timeout=5)
        assert early.state == pb.WARMUP_STATE_RUNNING and not early.ready

        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=120
        )
        seen = []
        for update in watch:
            seen.append(update.status)
            if update.status == SERVING:
                break
        watch.cancel()
        assert seen[0] == NOT_SERVING and seen[-1] == SERVING, seen
        assert health_statuses(channel) == {"": SERVING, SERVICE_NAME: SERVING}
        assert http_get(f"{server.http_url}/readyz") == (200, "ready\n")
        pb_grpc.PrefillMetadataStub(channel).BuildChunk(E1, timeout=5)

    metrics = scrape(server)
    assert metrics.value("indexer_warmup_keys", state="planned") == 3
    assert metrics.value("indexer_warmup_keys", state="compiled") == 3
    assert metrics.value("indexer_warmup_keys", state="cached") == 0
    assert metrics.value("indexer_warmup_keys", state="failed") == 0
    per_key = {s.labels["key"]: s.value for s in metrics.samples("indexer_warmup_key_compile_seconds")}
    assert set(per_key) == DEFAULT_KEY_LABELS and all(v > 0 for v in per_key.values())
    assert metrics.value("indexer_compile_duration_seconds_count", phase="warmup") == 3
    assert metrics.value("indexer_warmup_duration_seconds") >= max(per_key.values())  # keys compile in parallel
    assert metrics.value("indexer_ready") == 1

    log = server.log()
    order = [
        "listening grpc=127.0.0.1:",
        "warmup start keys=3 target=cuda:90",
        "warmup 1/3 key=",
        "warmup 3/3 key=",
        "warmup done keys=3",
        "ready backend=numpy",
    ]
    positions = [log.find(line) for line in order]
    assert -1 not in positions and positions == sorted(positions), log


def warmup_key_states(server: ServiceProcess) -> dict[str, object]:
    """What GetWarmupStatus, the metric and `indexer-service check` say of the warmup's keys."""
    with grpc.insecure_channel(server.address) as channel:
        status = pb_grpc.PrefillMetadataStub(channel).GetWarmupStatus(pb.GetWarmupStatusRequest(), timeout=10)
    metrics = scrape(server)
    check = subprocess.run(
        [INDEXER_SERVICE, "check", server.address], capture_output=True, text=True, timeout=60, env=clean_env()
    )
    assert check.returncode == 0, check.stdout + check.stderr
    return {
        "rpc": [pb.KeyState.Name(k.state) for k in status.keys],
        "seconds": [k.compile_seconds for k in status.keys],
        "metric": {s: metrics.value("indexer_warmup_keys", state=s) for s in ("compiled", "cached", "failed")},
        "check": re.search(r"compiled=\d+ cached=\d+ failed=\d+", check.stdout).group(0),
        "logged": re.findall(r"warmup \d/3 key=\S+ seconds=\S+ source=(\w+)", server.log()),
    }


def test_a_cold_start_reports_keys_compiled_and_a_warm_one_cached(start_server: StartServer, tmp_path: Path) -> None:
    """The same keys on an empty Triton cache, then on the cache that start filled: GetWarmupStatus says COMPILED
    for each key of the first and CACHED (a state of its own, not COMPILED) for each of the second, as the metric,
    `indexer-service check` and the log do."""
    cache = clean_env(TRITON_CACHE_DIR=str(tmp_path / "cache"))
    cold = start_server("--backend", "numpy", env=cache)
    cold_states = warmup_key_states(cold)
    cold.kill()
    warm_states = warmup_key_states(start_server("--backend", "numpy", env=cache))
    assert {k: v for k, v in cold_states.items() if k != "seconds"} == {
        "rpc": ["KEY_STATE_COMPILED"] * 3,
        "metric": {"compiled": 3, "cached": 0, "failed": 0},
        "check": "compiled=3 cached=0 failed=0",
        "logged": ["compiler"] * 3,
    }
    assert {k: v for k, v in warm_states.items() if k != "seconds"} == {
        "rpc": ["KEY_STATE_CACHED"] * 3,
        "metric": {"compiled": 0, "cached": 3, "failed": 0},
        "check": "compiled=0 cached=3 failed=0",
        "logged": ["cache"] * 3,
    }
    assert all(seconds > 0 for seconds in cold_states["seconds"] + warm_states["seconds"])


def test_a_failed_compile_keeps_the_server_not_ready(start_server: StartServer) -> None:
    server = start_server(*FAILING_WARMUP, ready=False)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.PrefillMetadataStub(channel)
        deadline = time.monotonic() + 60
        while (status := stub.GetWarmupStatus(pb.GetWarmupStatusRequest(), timeout=5)).state == (
            pb.WARMUP_STATE_RUNNING
        ):
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        assert status.state == pb.WARMUP_STATE_FAILED and not status.ready
        assert [k.state for k in status.keys] == [pb.KEY_STATE_FAILED] * 3
        assert all("sm_1" in k.error for k in status.keys), [k.error for k in status.keys]

        assert health_statuses(channel) == {"": NOT_SERVING, SERVICE_NAME: NOT_SERVING}
        status_code, body = http_get(f"{server.http_url}/readyz")
        assert status_code == 503 and body.startswith("warmup failed"), body
        with pytest.raises(grpc.RpcError) as refused:
            stub.BuildChunk(E1, timeout=5)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "warmup failed" in refused.value.details()

    metrics = scrape(server)
    assert metrics.value("indexer_warmup_keys", state="failed") == 3
    assert metrics.value("indexer_warmup_keys", state="compiled") == 0
    assert metrics.value("indexer_warmup_failures_total") == 3
    assert metrics.value("indexer_ready") == 0
    log = server.log()
    for label in DEFAULT_KEY_LABELS:
        assert f"key={label}" in log and "failed error=" in log
    assert "sm_1" in log and "warmup failed failed=3/3" in log
    assert server.process.poll() is None, "fail closed means not ready, not a crash"


def test_warmup_off_reports_keys_skipped_and_is_ready_at_once(start_server: StartServer) -> None:
    server = start_server("--warmup-target", "none", "--backend", "numpy")
    with grpc.insecure_channel(server.address) as channel:
        status = pb_grpc.PrefillMetadataStub(channel).GetWarmupStatus(pb.GetWarmupStatusRequest(), timeout=5)
    assert status.state == pb.WARMUP_STATE_SKIPPED and status.ready and status.target == "none"
    assert [k.state for k in status.keys] == [pb.KEY_STATE_SKIPPED] * 3
    metrics = scrape(server)
    assert metrics.value("indexer_warmup_keys", state="planned") == 3
    assert metrics.value("indexer_warmup_keys", state="compiled") == 0
    assert metrics.value("indexer_ready") == 1


def test_an_unwritable_port_file_stops_the_start_at_once(tmp_path: Path) -> None:
    """Before: the error was printed and the process lived on half-started (gRPC refusing, /readyz 503 with a
    false reason). Now: exit 1 before anything listens, one line naming the port file."""
    import subprocess

    from testkit.harness import INDEXER_SERVICE, listen_flags

    port_file = tmp_path / "missing-dir" / "ports.json"
    start = time.monotonic()
    out = subprocess.run(
        [
            INDEXER_SERVICE,
            "serve",
            "--backend",
            "numpy",
            *listen_flags(),
            "--port-file",
            str(port_file),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(TRITON_CACHE_DIR=str(tmp_path / "cache")),
    )
    assert out.returncode == 1, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("indexer-service serve:")]
    assert errors == [f"indexer-service serve: cannot write --port-file {port_file}: No such file or directory"]
    assert "Traceback" not in out.stderr and "listening" not in out.stderr and "warmup start" not in out.stderr
    assert time.monotonic() - start < 60


def test_the_start_up_log_states_the_tls_mode(start_server: StartServer, tmp_path: Path) -> None:
    import trustme

    from indexer_service.service.config import load_config
    from indexer_service.service.process.server import tls_mode

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    paths = {name: str(tmp_path / f"{name}.pem") for name in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(paths["ca"])
    cert.cert_chain_pems[0].write_to_path(paths["cert"])
    cert.private_key_pem.write_to_path(paths["key"])
    tls = {"tls_cert_file": paths["cert"], "tls_key_file": paths["key"], "warmup_target": "none"}
    assert tls_mode(load_config({"warmup_target": "none"}, env={})) == "off"
    assert tls_mode(load_config(tls, env={})) == "tls"
    assert tls_mode(load_config(tls | {"tls_client_ca_file": paths["ca"]}, env={})) == "mutual"

    plain = start_server("--warmup-target", "none", "--backend", "numpy")
    assert "tls mode=off cert=- client_ca=-" in plain.log()
    mutual = start_server(
        "--warmup-target",
        "none",
        "--backend",
        "numpy",
        "--tls-cert-file",
        paths["cert"],
        "--tls-key-file",
        paths["key"],
        "--tls-client-ca-file",
        paths["ca"],
        ready=False,
    )
    assert f"tls mode=mutual cert={paths['cert']} client_ca={paths['ca']}" in mutual.log()
