"""grpc.health.v1 through the gate (service/transport/health.py) on a real health port: silent calls hold nothing
the probes need, requests that do not parse are refused and counted and kept by nothing, other methods are pointed
at the RPC port, and Watch on grpcio's public paths (no send without waiting, no non-blocking behaviour)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from indexer_service.service.adapters import grpcio
from indexer_service.service.config import load_config
from indexer_service.service.observability.metrics import Metrics
from indexer_service.service.reasons import ShedReason
from indexer_service.service.transport.gate import Accounting
from indexer_service.service.transport.grpc_server import HEALTH_NAMES, HealthServer, create_health_server
from indexer_service.service.transport.health import HealthServicer
from testkit.harness import OWN_CONNECTION, wait_for
from testkit.streams import sends_nothing

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
CHECK, LIST, WATCH = (f"/grpc.health.v1.Health/{m}" for m in ("Check", "List", "Watch"))


class Port:
    """A health port of its own (as the single process serves it) and what it counted."""

    def __init__(self) -> None:
        self.sheds: list[tuple[str, ShedReason, str]] = []
        self.metrics = Metrics()
        config = load_config(
            {"grpc_host": "127.0.0.1", "health_port": "0", "grpc_port": "50999", "warmup_target": "none"}, env={}
        )
        self.servicer = HealthServicer(HEALTH_NAMES)
        self.servicer.set_serving(True)
        self.health: HealthServer = create_health_server(
            config, self.servicer, Accounting(self.metrics, lambda *shed: self.sheds.append(shed))
        )
        self.health.server.start()
        self.channels: list[grpc.Channel] = []

    def channel(self) -> grpc.Channel:
        self.channels.append(grpc.insecure_channel(f"127.0.0.1:{self.health.port}", options=[OWN_CONNECTION]))
        return self.channels[-1]

    def reasons(self) -> list[ShedReason]:
        return [reason for _, reason, _ in self.sheds]

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        self.servicer.drain()
        self.health.stop()
        self.servicer.close()


@pytest.fixture
def port() -> Iterator[Port]:
    port = Port()
    yield port
    port.close()


def probe(port: Port) -> int:
    return health_pb2_grpc.HealthStub(port.channel()).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_silent_checks_and_watches_leave_the_probes_answered(port: Port) -> None:
    # The health lane has two threads; a silent call holds none (nor a place) while its request does not come.
    leave = threading.Event()
    channel = port.channel()
    try:
        checks = [channel.stream_unary(CHECK).future(sends_nothing(leave), timeout=30) for _ in range(4)]
        watches = [channel.stream_stream(WATCH)(sends_nothing(leave), timeout=30) for _ in range(4)]
        wait_for(lambda: len(port.health.gate.lanes[1].waiting) == 8, 5, "the eight silent calls at the gate")
        for _ in range(3):
            assert probe(port) == SERVING
        watch = health_pb2_grpc.HealthStub(port.channel()).Watch(health_pb2.HealthCheckRequest(), timeout=10)
        assert next(watch).status == SERVING
        watch.cancel()
    finally:
        leave.set()
    for call in checks:
        assert call.exception(10).code() == grpc.StatusCode.UNIMPLEMENTED
    for call in watches:
        with pytest.raises(grpc.RpcError) as ended:
            next(call)
        assert ended.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("path", [CHECK, LIST, WATCH], ids=["Check", "List", "Watch"])
def test_a_request_that_does_not_parse_is_refused_counted_and_logged_once(port: Port, path: str, caplog) -> None:
    channel = port.channel()
    call: Callable = channel.unary_stream(path) if path == WATCH else channel.unary_unary(path)
    with caplog.at_level(logging.DEBUG):
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as refused:
                answer = call(b"\xff\xff\xff", timeout=5)
                if path == WATCH:
                    next(answer)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "does not parse" in refused.value.details()
    assert port.reasons() == [ShedReason.UNDECODABLE] * 20
    assert not [r for r in caplog.records if r.exc_info]  # no traceback per call (the shed log is rate-limited)
    assert probe(port) == SERVING


def test_undecodable_watches_keep_no_memory(port: Port) -> None:
    # grpcio's own deserializer path for Watch kept ~20 KiB a call for good; here the calls go, and their memory.
    watch = port.channel().unary_stream(WATCH)

    def refuse(n: int) -> None:
        for _ in range(n):
            with pytest.raises(grpc.RpcError):
                next(watch(b"\xff\xff\xff", timeout=5))

    refuse(500)  # warm: the channel, the server's arenas
    before = psutil.Process().memory_info().rss
    refuse(2000)
    grown = psutil.Process().memory_info().rss - before
    assert grown < 8 * 2**20, f"{grown / 2**20:.1f} MiB kept by 2,000 refused Watch calls"  # grpcio's leak: ~40 MiB
    assert port.reasons().count(ShedReason.UNDECODABLE) == 2500
    wait_for(lambda: port.health.gate.held(port.health.gate.lanes[1]) == 0, 5, "every place back")


def test_another_method_on_the_health_port_is_pointed_at_the_rpc_port(port: Port) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        port.channel().unary_unary("/indexer.v1.PrefillMetadata/BuildChunk")(b"", timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "health port" in refused.value.details() and "port 50999" in refused.value.details()
    errors = port.metrics.registry.get_sample_value(
        "indexer_request_errors_total", {"method": "unknown", "code": "UNIMPLEMENTED"}
    )
    assert errors == 1


@pytest.mark.parametrize("public_path", ["blocking_send", "no_send_callback"])
def test_watch_on_grpcios_public_paths(monkeypatch, public_path: str) -> None:
    # Where grpcio's internals differ, Watch sends through grpcio's own send (which waits), or, where grpcio does
    # not call a non-blocking behaviour with a send callback, as a generator of the stream's messages.
    on = grpcio.features()
    monkeypatch.setattr(grpcio, "features", lambda: grpcio.GrpcioFeatures(on.call_state, on.receive_ahead, False))
    if public_path == "no_send_callback":
        monkeypatch.setattr(grpcio, "non_blocking", lambda behaviour: behaviour)
    port = Port()
    try:
        watch = health_pb2_grpc.HealthStub(port.channel()).Watch(health_pb2.HealthCheckRequest(), timeout=20)
        assert next(watch).status == SERVING
        port.servicer.set_serving(False)
        assert next(watch).status == NOT_SERVING
        port.servicer.set_serving(True)
        assert next(watch).status == SERVING
        assert port.servicer.drain() == 1
        assert next(watch).status == NOT_SERVING
        with pytest.raises(StopIteration):
            next(watch)
        assert probe(port) == NOT_SERVING
    finally:
        port.close()
