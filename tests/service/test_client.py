"""The scheduler's client against real server processes: numpy in and out, round-robin over replicas, retries
through the service config when a replica drains or dies, health checks that skip a replica that is not
ready, deadlines; metadata of the client and of each call; a bounded reconnect backoff; what it says when no
server, or the health port, answers."""

from __future__ import annotations

import itertools
import json
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from indexer_service.client import (
    IndexerClient,
    channel_target,
    checked_metadata,
    reconnect_options,
    service_config,
)
from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.kernels.numpy_backend import build_chunk_metadata_numpy
from indexer_service.kernels.planner import BatchInputs
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.protos.indexer.v1 import indexer_pb2_grpc as pb_grpc
from indexer_service.service.codec import SERVICE_NAME, encode_int32
from testkit.harness import FAST_START, ServiceProcess, wait_for
from tests.service.conftest import FAILING_WARMUP, StartServer, scrape

pytestmark = pytest.mark.slow

E1 = ChunkInputs(np.array([0, 1, 4, 9], dtype=np.int64), np.array([20, 10, 5], dtype=np.int64), 4, 1, 3)
# A chunk the server refuses, INVALID_ARGUMENT (query_start_loc goes down), and a batch it refuses likewise.
BAD_CHUNK = ChunkInputs(np.array([0, 5, 3]), np.array([5, 5]), 4, 0, 2)
BAD_BATCH = BatchInputs(np.array([0, 5, 3]), np.array([5, 5]), 4, num_decodes=0, max_model_len=64)
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"  # W3C trace context's example


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


class RecordsMetadata(grpc.GenericRpcHandler):
    """Records the method and the metadata of every call it sees, and answers none (UNIMPLEMENTED)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, list[str | bytes]]]] = []

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> None:
        sent: dict[str, list[str | bytes]] = {}
        for key, value in handler_call_details.invocation_metadata:
            sent.setdefault(key, []).append(value)
        self.calls.append((handler_call_details.method.rsplit("/", 1)[-1], sent))
        return None


def test_metadata_of_the_client_and_of_each_call_reach_the_server() -> None:
    """Every method sends the client's metadata and the call's; a key the call gives replaces the client's, every
    other entry of the client's stays (a key given twice included), and keys are sent in lowercase."""
    recorder = RecordsMetadata()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((recorder,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    defaults = (("X-Request-Id", "client-id"), ("x-tenant", "a"), ("x-tenant", "b"), ("x-token-bin", b"\x00\xff"))
    calls = [
        lambda c, m: c.build_chunk(E1, metadata=m),
        lambda c, m: c.plan_batch(BAD_BATCH, metadata=m),
        lambda c, m: c.warmup_status(metadata=m),
        lambda c, m: c.health(metadata=m),
    ]
    try:
        with IndexerClient(f"127.0.0.1:{port}", health_check=False, max_attempts=1, metadata=defaults) as client:
            for call in calls:
                for metadata in (
                    None,
                    [("x-request-id", "call-id"), ("traceparent", TRACEPARENT)],
                ):
                    with pytest.raises(grpc.RpcError) as refused:
                        call(client, metadata)
                    assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(None).wait()
    assert [method for method, _ in recorder.calls] == [
        m for m in ("BuildChunk", "PlanBatch", "GetWarmupStatus", "Check") for _ in range(2)
    ]
    for index, (method, sent) in enumerate(recorder.calls):
        assert sent["x-tenant"] == ["a", "b"] and sent["x-token-bin"] == [b"\x00\xff"], method
        if index % 2 == 0:
            assert sent["x-request-id"] == ["client-id"] and "traceparent" not in sent, method
        else:
            assert sent["x-request-id"] == ["call-id"] and sent["traceparent"] == [TRACEPARENT], method


@pytest.mark.parametrize(
    ("metadata", "fragment"),
    [
        ([("x request id", "a")], "letters, digits"),
        ([("grpc-timeout", "1S")], "grpc-"),
        ([("x-trace-bin", "text")], "takes bytes"),
        ([("x-request-id", "line\nbreak")], "printable ASCII"),
        ([("x-request-id", "caf\u00e9")], "printable ASCII"),
        ([("x-request-id", b"bytes")], "printable ASCII"),
        (["x-request-id"], "(key, value) pair"),
    ],
)
def test_metadata_gRPC_would_refuse_is_a_value_error_naming_it(metadata: list, fragment: str) -> None:
    """Before: INTERNAL "Invalid metadata" from the call, as if the server had failed."""
    with pytest.raises(ValueError, match=re.escape(fragment)):
        checked_metadata(metadata)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        IndexerClient("127.0.0.1:1", metadata=metadata)
    with IndexerClient("127.0.0.1:1") as client, pytest.raises(ValueError, match=re.escape(fragment)):
        client.build_chunk(E1, metadata=metadata, timeout=1)


def test_a_request_id_sent_by_the_client_comes_back_and_names_the_server_s_log_line(start_server: StartServer) -> None:
    """The call's request id, else the client's, is the one the server logs on the failed call's line and returns
    in the trailing metadata."""
    server = start_server(*FAST_START)
    with IndexerClient(server.address, metadata=(("x-request-id", "sched-7-default"),)) as client:
        with pytest.raises(grpc.RpcError) as chunk:
            client.build_chunk(BAD_CHUNK, metadata=(("x-request-id", "sched-7-call-1"),))
        with pytest.raises(grpc.RpcError) as plan:  # another method: its own line within the log's rate limit
            client.plan_batch(BAD_BATCH)
    for refused, request_id, method in (
        (chunk, "sched-7-call-1", "BuildChunk"),
        (plan, "sched-7-default", "PlanBatch"),
    ):
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert ("x-request-id", request_id) in [(m.key, m.value) for m in refused.value.trailing_metadata()]

        def logged(request_id: str = request_id, method: str = method) -> list[str]:
            return [
                line
                for line in server.log().splitlines()
                if f"rpc method={method} code=INVALID_ARGUMENT" in line and line.endswith(f"request_id={request_id}")
            ]

        wait_for(logged, 10, f"the failed {method} call's log line")


def test_an_rpc_sent_to_the_health_port_is_told_the_rpc_port(start_server: StartServer) -> None:
    """The health port answers SERVING to the client's health checks, then refuses the RPC itself: UNIMPLEMENTED,
    naming the port the RPCs are on (the one bound, though the server was given port 0)."""
    server = start_server(*FAST_START)
    with IndexerClient(f"127.0.0.1:{server.health_port}") as client, pytest.raises(grpc.RpcError) as refused:
        client.build_chunk(E1, timeout=10)
    assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED
    details = refused.value.details()
    assert "this is the health port" in details and f"on port {server.grpc_port}" in details, details


def test_without_wait_for_ready_no_server_is_unavailable_at_once_naming_the_address() -> None:
    """Nothing listens on the port: UNAVAILABLE with the address and the connection's error, after the retry
    policy's backoff (0.05 + 0.1 + 0.2 + 0.4 s), not at the deadline; with one attempt, at once."""
    address = f"127.0.0.1:{free_port()}"
    for attempts, within in ((5, 5.0), (1, 1.0)):
        with IndexerClient(address, wait_for_ready=False, max_attempts=attempts) as client:
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                client.build_chunk(E1, timeout=30)
            took = time.monotonic() - start
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert address in refused.value.details() and "refused" in refused.value.details(), refused.value.details()
        assert took < within, (attempts, took)


def test_reconnect_backoff_options() -> None:
    assert reconnect_options(None) == []
    assert dict(reconnect_options(5.0)) == {
        "grpc.max_reconnect_backoff_ms": 5000,
        "grpc.initial_reconnect_backoff_ms": 1000,
        "grpc.dns_min_time_between_resolutions_ms": 5000,
    }
    assert dict(reconnect_options(0.5))["grpc.initial_reconnect_backoff_ms"] == 500  # never above the cap
    assert dict(reconnect_options(0.01))["grpc.max_reconnect_backoff_ms"] == 100  # gRPC's floor
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="max_reconnect_backoff_seconds"):
            IndexerClient("127.0.0.1:1", max_reconnect_backoff_seconds=bad)


class AttemptRecorder:
    """A port that takes every connection and closes it at once (a failed attempt, as a refused one is, to gRPC),
    recording when each came."""

    def __init__(self, port: int = 0) -> None:
        self.socket = socket.create_server(("127.0.0.1", port), backlog=64)
        self.socket.settimeout(0.1)
        self.port = self.socket.getsockname()[1]
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self.socket.accept()
            except TimeoutError:
                continue
            self.times.append(time.monotonic())
            connection.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.socket.close()

    def longest_wait(self, until: float) -> float:
        """The longest time between two attempts, or from the last one to ``until``, still waiting."""
        marks = [*self.times, until]
        return max(b - a for a, b in itertools.pairwise(marks))


def call_in_vain(client: IndexerClient, timeout: float) -> None:
    """A call that waits for a server that never comes (its channel keeps trying to connect meanwhile)."""
    with pytest.raises(grpc.RpcError):
        client.build_chunk(E1, timeout=timeout)


def timed_call(client: IndexerClient, timeout: float) -> float:
    """When (``time.monotonic()``) a call made now, waiting for a ready server, is answered."""
    assert client.build_chunk(E1, timeout=timeout) is not None
    return time.monotonic()


# The outage of the test below: long enough for gRPC's own backoff to show (see its docstring).
OUTAGE = 28.0


# Not `exclusive`: it spends 28 s of its 35 s waiting on timers, which a worker beside it confined to one CPU
# delays by milliseconds against its seconds of slack (7 s cap on a 6 s backoff, 10 s to full rate), while on the
# exclusive worker it held every attack test behind it for those 35 s.
def test_a_client_is_back_at_full_rate_within_10_s_of_a_server_restarted_after_an_outage(
    start_server: StartServer,
) -> None:
    """The server is killed and its port fails every connection for 28 s, then a new server takes the same port.
    Eight calls made during the outage wait, one on each of the client's eight connections (each call goes to the
    connection with the fewest in flight); every one is answered within 10 s of the new server being ready: the
    client is back at full rate.

    The same 28 s measure the backoff between attempts, one connection each to a port of its own that fails every
    attempt. The default cap (5 s, gRPC adds +-20 % jitter): no wait longer than 6 s (and a second of slack for a
    late timer). gRPC's own backoff (``None``): 1, 1.6, 2.56, 4.1, 6.55 then 10.5 s, each +-20 %; the sixth
    attempt comes by 19 s, so by 28 s either the seventh came after a wait of at least 8.4 s or the client has
    been waiting at least 9 s for it (where the reconnecting client above would have been without the cap)."""
    port = free_port()
    old = start_server(*FAST_START, "--grpc-port", str(port))
    recorders = {"capped": AttemptRecorder(), "grpc_default": AttemptRecorder()}
    caps = {"capped": 5.0, "grpc_default": None}
    lone = {
        name: IndexerClient(f"127.0.0.1:{r.port}", connections=1, max_reconnect_backoff_seconds=caps[name])
        for name, r in recorders.items()
    }
    try:
        with IndexerClient(f"127.0.0.1:{port}") as client:
            for _ in client.pool.channels:  # one call on each connection in turn: all eight connected
                assert client.build_chunk(E1, timeout=30) is not None
            for channel in client.pool.channels:
                grpc.channel_ready_future(channel).result(timeout=10)
            old.kill()
            down = time.monotonic()
            hold = AttemptRecorder(port)  # the port fails each attempt, and no other process takes it meanwhile
            try:
                with ThreadPoolExecutor(max_workers=10) as pool:
                    # A call makes each lone client's channel connect; it keeps trying after the deadline.
                    for lone_client in lone.values():
                        pool.submit(call_in_vain, lone_client, OUTAGE + 5)
                    answered = [pool.submit(timed_call, client, 90) for _ in client.pool.channels]
                    wait_for(lambda: all(r.times for r in recorders.values()), 10, "the first attempts")
                    first = min(r.times[0] for r in recorders.values())
                    time.sleep(max(0.0, max(down, first) + OUTAGE - time.monotonic()))
                    now = time.monotonic()
                    spacing = {name: round(r.longest_wait(now), 2) for name, r in recorders.items()}
                    attempts = {name: len(r.times) for name, r in recorders.items()}
                    for lone_client in lone.values():  # ends its call in vain: the pool's exit waits for it
                        lone_client.close()
                    hold.close()
                    restarted = time.monotonic()
                    start_server(*FAST_START, "--grpc-port", str(port))
                    ready = time.monotonic()
                    back = sorted(future.result(timeout=90) - ready for future in answered)
            finally:
                hold.close()
    finally:
        for lone_client in lone.values():
            lone_client.close()
        for recorder in recorders.values():
            recorder.close()
    figures = {
        "attempts_during_outage": len(hold.times),
        "start_to_ready_s": round(ready - restarted, 2),
        "first_call_after_ready_s": round(back[0], 2),
        "full_rate_after_ready_s": round(back[-1], 2),
    }
    print(f"reconnect after a {OUTAGE} s outage: {figures}")
    print(f"longest wait between connection attempts over {OUTAGE} s: {spacing}, attempts: {attempts}")
    assert back[-1] < 10.0, figures
    assert spacing["capped"] <= 5.0 * 1.2 + 1.0, (spacing, attempts)
    assert spacing["grpc_default"] > 8.0, (spacing, attempts)
    assert attempts["capped"] >= 6, attempts  # after 1, 1.6, 2.56 and 4.1 s, one every 6 s at most
