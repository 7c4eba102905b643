"""The scheduler's client against real server processes: numpy in and out, round-robin over replicas, retries
through the service config when a replica drains or dies, health checks that skip a replica that is not
ready, deadlines."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.kernels.numpy_backend import build_chunk_metadata_numpy
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.protos.indexer.v1 import indexer_pb2_grpc as pb_grpc
from indexer_service.service.client import IndexerClient, channel_target, service_config
from indexer_service.service.codec import SERVICE_NAME, encode_int32
from testkit.harness import FAST_START, ServiceProcess, wait_for
from tests.service.conftest import FAILING_WARMUP, StartServer, scrape

pytestmark = pytest.mark.slow

E1 = ChunkInputs(np.array([0, 1, 4, 9], dtype=np.int64), np.array([20, 10, 5], dtype=np.int64), 4, 1, 3)


def served(server: ServiceProcess, code: str = "OK") -> float:
    return scrape(server).value("indexer_request_duration_seconds_count", method="BuildChunk", code=code) or 0.0


def test_round_robin_spreads_calls_over_every_replica(start_server: StartServer) -> None:
    servers = [start_server(*FAST_START) for _ in range(3)]
    expected = build_chunk_metadata_numpy(E1)
    with IndexerClient([s.address for s in servers]) as client:
        # Each connection puts a replica in its rotation once that replica's health watch says SERVING, one
        # after another: count the calls made once every replica is in.
        wait_for(lambda: client.build_chunk(E1) is not None and all(map(served, servers)), 20, "every replica served")
        before = [served(s) for s in servers]
        for _ in range(60):
            got = client.build_chunk(E1)
            assert got.cu_seqlen_ke.tolist() == expected.cu_seqlen_ke.tolist()
            assert got.cu_seqlen_ke.dtype == np.int32
    counts = [served(s) - b for s, b in zip(servers, before, strict=True)]
    assert sum(counts) == 60 and all(c >= 10 for c in counts), counts


def test_no_call_fails_while_one_replica_drains_and_another_dies(start_server: StartServer) -> None:
    draining, dying, survivor = (start_server(*FAST_START) for _ in range(3))
    failures: list[BaseException] = []
    ok = [0]
    stop = threading.Event()

    def burst(client: IndexerClient) -> None:
        while not stop.is_set():
            try:
                client.build_chunk(E1, timeout=20)
                ok[0] += 1
            except grpc.RpcError as exc:
                failures.append(exc)

    with IndexerClient([s.address for s in (draining, dying, survivor)]) as client:
        threads = [threading.Thread(target=burst, args=(client,)) for _ in range(3)]
        try:
            for thread in threads:
                thread.start()
            wait_for(lambda: ok[0] >= 20, 20, "calls before the replicas leave")
            draining.process.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            dying.process.kill()
            before = ok[0]
            wait_for(lambda: ok[0] >= before + 20, 20, "calls after the two replicas left")
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
    assert not failures, [f"{e.code()}: {e.details()}" for e in failures]
    assert draining.process.wait(30) == 0
    assert served(survivor) > 0


def test_a_replica_that_is_not_ready_gets_no_calls(start_server: StartServer) -> None:
    ready = start_server(*FAST_START)
    failed = start_server(*FAILING_WARMUP, ready=False)
    with IndexerClient([failed.address, ready.address]) as client:
        for _ in range(20):
            client.build_chunk(E1)
    assert served(ready) == 20
    assert served(failed, "UNAVAILABLE") == 0 and served(failed) == 0
    # Without the health check the same call reaches it, and it answers UNAVAILABLE itself.
    with (
        IndexerClient(failed.address, health_check=False, max_attempts=1) as client,
        pytest.raises(grpc.RpcError) as refused,
    ):
        client.build_chunk(E1)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


def test_deadline_is_enforced(start_server: StartServer) -> None:
    server = start_server(*FAST_START)
    heavy = ChunkInputs(np.array([0, 8192]), np.array([1_000_000]), 1, 0, 1)
    with IndexerClient(server.address) as client:
        with pytest.raises(grpc.RpcError) as late:
            client.build_chunk(heavy, timeout=0.001)
        assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert client.build_chunk(heavy, omit_token_to_seq=True).token_to_seq is None


def test_channel_targets() -> None:
    assert channel_target("dns:///indexer:50051") == "dns:///indexer:50051"
    assert channel_target("localhost:50051") == "localhost:50051"
    assert channel_target(["127.0.0.1:1", "127.0.0.1:2"]) == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert channel_target(["[::1]:1", "[::1]:2"]) == "ipv6:[::1]:1,[::1]:2"
    assert channel_target(["localhost:50051"]) == "dns:///localhost:50051"
    assert channel_target(["indexer.ns.svc.cluster.local:50051"]) == "dns:///indexer.ns.svc.cluster.local:50051"
    assert channel_target(["dns:///indexer:50051"]) == "dns:///indexer:50051"
    for bad, fragment in [
        ([], "no server address"),
        (["a:1", "b:1"], "dns:///name:port"),
        (["a:1", "127.0.0.1:1"], "dns:///name:port"),
        (["127.0.0.1:1", "[::1]:1"], "IPv4 and IPv6"),
        (["localhost"], "host:port"),
        (["::1:50051"], "brackets"),
        (["dns:///a:1", "dns:///b:1"], "stands alone"),
    ]:
        with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
            channel_target(bad)


def test_a_host_name_in_the_list_form_works(start_server: StartServer) -> None:
    """The README's list form with a host name: ``localhost`` resolves (to ::1 too, where nothing listens:
    round-robin uses the address that answers)."""
    server = start_server(*FAST_START)
    with IndexerClient([f"localhost:{server.grpc_port}"], timeout=30) as client:
        assert client.build_chunk(E1).total_seq_lens == build_chunk_metadata_numpy(E1).total_seq_lens
    with IndexerClient(f"dns:///localhost:{server.grpc_port}", timeout=30) as client:
        assert client.build_chunk(E1) is not None


def test_calls_wait_for_a_warming_replica_within_their_deadline(start_server: StartServer, tmp_path) -> None:
    """Wait for ready (the default): a call made while the only replica warms up is answered once it is ready.
    Without it the call fails UNAVAILABLE at once, long before its deadline."""
    from testkit.harness import clean_env, http_get

    cold = clean_env(TRITON_CACHE_DIR=str(tmp_path / "cold-cache"))  # a cold cache: the warmup takes seconds
    server = start_server("--backend", "numpy", ready=False, env=cold)
    assert http_get(f"{server.http_url}/readyz")[0] == 503
    with IndexerClient([server.address], wait_for_ready=False, max_attempts=1) as client:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            client.build_chunk(E1, timeout=60)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - start < 10
    assert http_get(f"{server.http_url}/readyz")[0] == 503, "warmed up too fast to tell"
    with IndexerClient([server.address]) as client:
        assert client.build_chunk(E1, timeout=120) is not None
    assert "warmup done" in server.log()
    assert served(server) >= 1


def test_a_call_made_before_the_server_starts_waits_for_it(start_server: StartServer) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result: dict[str, object] = {}

    def call() -> None:
        with IndexerClient([f"127.0.0.1:{port}"]) as client:
            try:
                result["metadata"] = client.build_chunk(E1, timeout=90)
            except grpc.RpcError as exc:
                result["error"] = exc

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(1.0)
    assert caller.is_alive(), result  # waiting, not failed
    server = start_server(*FAST_START, "--grpc-port", str(port))
    caller.join(90)
    assert "error" not in result, result
    assert result["metadata"] is not None and served(server) == 1
    with IndexerClient([f"127.0.0.1:{free_port()}"], wait_for_ready=False) as client:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            client.build_chunk(E1, timeout=30)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE and time.monotonic() - start < 15


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_service_config_retries_idempotent_calls_round_robin() -> None:
    config = json.loads(service_config())
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": SERVICE_NAME}
    (method,) = config["methodConfig"]
    assert method["name"] == [{"service": SERVICE_NAME}]
    assert set(method["retryPolicy"]["retryableStatusCodes"]) == {"UNAVAILABLE", "CANCELLED"}
    single = json.loads(service_config(max_attempts=1, health_check=False))
    assert "retryPolicy" not in single["methodConfig"][0] and "healthCheckConfig" not in single


class RefusesFirstAttempts(pb_grpc.PrefillMetadataServicer):
    """Answers each call's first attempts with the codes a shutting-down server gives, then the status."""

    def __init__(self, codes: list[grpc.StatusCode]) -> None:
        self.codes = codes
        self.attempts = 0

    def GetWarmupStatus(self, request: pb.GetWarmupStatusRequest, context: grpc.ServicerContext) -> object:
        self.attempts += 1
        if self.attempts <= len(self.codes):
            context.abort(self.codes[self.attempts - 1], "shutting down")
        return pb.GetWarmupStatusResponse(state=pb.WARMUP_STATE_READY)


@pytest.mark.parametrize("codes", [["UNAVAILABLE"], ["CANCELLED"], ["CANCELLED", "UNAVAILABLE"]])
def test_codes_of_a_shutting_down_server_are_retried(codes: list[str]) -> None:
    """grpc/grpc#41785: a server shutting down answers CANCELLED to calls it had not yet handed to a handler;
    the caller must not see it, any more than UNAVAILABLE."""
    servicer = RefusesFirstAttempts([grpc.StatusCode[c] for c in codes])
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PrefillMetadataServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with IndexerClient(f"127.0.0.1:{port}", health_check=False) as client:
            assert client.warmup_status(timeout=5).state == pb.WARMUP_STATE_READY
        assert servicer.attempts == len(codes) + 1
        with IndexerClient(f"127.0.0.1:{port}", health_check=False, max_attempts=1) as client:
            servicer.attempts = 0
            with pytest.raises(grpc.RpcError) as refused:
                client.warmup_status(timeout=5)
            assert refused.value.code() is grpc.StatusCode[codes[0]]
    finally:
        server.stop(None).wait()


def test_arrays_outside_int32_are_refused_before_sending() -> None:
    with pytest.raises(ValueError, match="seq_lens: values must fit int32"):
        encode_int32(np.array([2**31]), "seq_lens")
    with pytest.raises(ValueError, match="integers"):
        encode_int32(np.array([1.5]), "seq_lens")
