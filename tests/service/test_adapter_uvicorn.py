"""service/adapters/uvicorn_http.py: the probe names each uvicorn internal the limited protocol relies on when it is
missing or differs, and the service then serves on uvicorn's public settings (and says so); the protocol's own faults
drop one connection, counted and logged, never the event loop (that nothing else in the product reaches into uvicorn:
tests/service/test_adapters.py). Real uvicorn servers on 127.0.0.1; the installed uvicorn's classes, with one internal
hidden at a time."""

from __future__ import annotations

import contextlib
import http.client
import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from google.protobuf import json_format

from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.service import adapters
from indexer_service.service.adapters import uvicorn_http
from indexer_service.service.config import load_config
from indexer_service.service.observability.metrics import Metrics
from indexer_service.service.process.server import IndexerServer
from indexer_service.service.reasons import HttpRefusal, Port
from indexer_service.service.transport.http_app import HttpConnectionEvents, HttpRefusals
from testkit.harness import FLOOD_PEER, LOOPBACK, http_get, wait_for
from testkit.http1raw import chunked_request, seconds_until_closed
from testkit.payloads import BUILD_CHUNK_PATH, SMALL_BUILD_CHUNK

LIMITS = uvicorn_http.HttpLimits(max_head_bytes=1024, idle_seconds=0.5, max_connections=100)


@pytest.fixture
def fresh_fallbacks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This test's fallbacks only: the process-wide registry starts empty and is put back afterwards, and the
    once-a-process probe runs again within the test and after it."""
    monkeypatch.setattr(adapters, "_taken", {})
    uvicorn_http.limited_protocol_on.cache_clear()
    yield
    uvicorn_http.limited_protocol_on.cache_clear()


def module() -> Any:
    import uvicorn.protocols.http.httptools_impl as httptools_impl

    return httptools_impl


def init_setting(names: tuple[str, ...]) -> Any:
    """An ``__init__`` whose code sets exactly ``names`` on self."""
    source = "def __init__(self, *args, **kwargs):\n" + "".join(f"    self.{name} = None\n" for name in names)
    scope: dict[str, Any] = {}
    exec(source + "    return None\n", scope)
    return scope["__init__"]


def method_naming(parameters: tuple[str, ...], names: tuple[str, ...]) -> Any:
    """A method taking ``parameters`` (self aside) whose code names ``names``, and nothing else."""
    body = "".join(f"    self.{name}\n" for name in names) or "    pass\n"
    scope: dict[str, Any] = {}
    exec(f"def method(self{''.join(', ' + p for p in parameters)}):\n{body}", scope)
    return scope["method"]


def hide(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Take ``name`` (one of RELIED_ON) away from the installed uvicorn, or make it other than relied on."""
    mod = module()
    if name == uvicorn_http.MODULE:
        monkeypatch.setitem(sys.modules, name, None)  # importing it fails, as where it is absent
        return
    if "." not in name:
        monkeypatch.delattr(mod, name)
        return
    owner_name, _, rest = name.partition(".")
    owner = getattr(mod, owner_name)
    if " -> " in rest:  # one of uvicorn's methods no longer uses what the limited protocol relies on it using
        method, _, called = rest.partition(" -> ")
        others = tuple(c for m, c in uvicorn_http.CALLS if m == method and c != called)
        monkeypatch.setattr(owner, method, method_naming(uvicorn_http.METHODS[method], others))
    elif rest in uvicorn_http.METHODS:
        monkeypatch.delattr(owner, rest)
    else:  # an attribute uvicorn's __init__ no longer sets
        others = tuple(n for n in uvicorn_http.ATTRIBUTES[owner_name] if n != rest)
        monkeypatch.setattr(owner, "__init__", init_setting(others))


def test_the_installed_uvicorn_has_everything_the_limited_protocol_relies_on(fresh_fallbacks) -> None:
    assert uvicorn_http.probe() == ()
    settings = uvicorn_http.protocol_settings(LIMITS, events=None)  # type: ignore[arg-type]
    assert issubclass(settings["http"], module().HttpToolsProtocol)


@pytest.mark.parametrize("name", uvicorn_http.RELIED_ON)
def test_each_hidden_internal_is_named_and_takes_the_fallback(monkeypatch, fresh_fallbacks, name: str) -> None:
    hide(monkeypatch, name)
    assert uvicorn_http.probe() == (name,)
    assert uvicorn_http.protocol_settings(LIMITS, events=None) == uvicorn_http.public_settings(LIMITS)  # type: ignore[arg-type]
    (taken,) = adapters.taken()
    assert (taken.library, taken.feature, taken.missing) == ("uvicorn", "limited_protocol", (name,))
    assert taken.public_path == uvicorn_http.PUBLIC_PATH
    assert adapters.summary() == "uvicorn.limited_protocol"  # the start line's dependency_fallbacks


@pytest.mark.parametrize("method", uvicorn_http.METHODS)
def test_a_method_taking_other_parameters_is_named(monkeypatch, fresh_fallbacks, method: str) -> None:
    """One more required parameter, or one fewer, is named; one more with a default is not (it is still called
    as the limited protocol calls it)."""
    parameters = uvicorn_http.METHODS[method]
    calls = tuple(c for m, c in uvicorn_http.CALLS if m == method)
    named = (f"HttpToolsProtocol.{method}({', '.join(parameters)})",)
    for other in ((*parameters, "extra"), parameters[:-1] if parameters else None):
        if other is not None:
            monkeypatch.setattr(module().HttpToolsProtocol, method, method_naming(other, calls))
            assert uvicorn_http.probe() == named, other
    monkeypatch.setattr(module().HttpToolsProtocol, method, method_naming((*parameters, "extra=None"), calls))
    assert uvicorn_http.probe() == ()


def test_the_public_settings_are_uvicorns_public_config() -> None:
    """Every fallback setting is a keyword of uvicorn.Config, and takes: h11 with the head bound."""
    config = uvicorn.Config(lambda scope, receive, send: None, **uvicorn_http.public_settings(LIMITS))
    assert config.http == "h11" and config.h11_max_incomplete_event_size == 1024
    assert config.limit_concurrency == 100 and config.timeout_keep_alive == 0.5


class FaultyEvents:
    """Events whose every report but ``failed`` raises (``opened`` the first time only)."""

    def __init__(self) -> None:
        self.failures: list[tuple[str, str]] = []
        self.opened_once = False

    def opened(self, connection: object, open_connections: int) -> HttpRefusal | None:
        if not self.opened_once:
            self.opened_once = True
            raise RuntimeError("opened failed")
        return None

    def closed(self, connection: object) -> None:
        pass

    def refused(self, reason: HttpRefusal, address: object) -> bytes:
        raise RuntimeError(f"refused failed: {reason}")

    def timed_out(self) -> None:
        raise RuntimeError("timed_out failed")

    def failed(self, callback: str, address: object, error: Exception) -> None:
        self.failures.append((callback, str(error)))


async def hello(scope, receive, send) -> None:
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@contextlib.contextmanager
def serving(settings: dict[str, object]) -> Iterator[int]:
    """A real uvicorn server answering :func:`hello` with ``settings``, on its own thread; its port."""
    config = uvicorn.Config(hello, loop="uvloop", lifespan="off", log_config=None, **settings)
    server = uvicorn.Server(config)
    bound = socket.create_server((LOOPBACK, 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [bound]})
    thread.start()
    try:
        wait_for(lambda: server.started, 10.0, "uvicorn started")
        yield bound.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10.0)
        bound.close()


@pytest.fixture
def faulty_server(fresh_fallbacks) -> Iterator[tuple[int, FaultyEvents]]:
    """A real uvicorn server on the limited protocol, telling :class:`FaultyEvents`."""
    events = FaultyEvents()
    with serving(uvicorn_http.protocol_settings(LIMITS, events)) as port:
        yield port, events


def closed_without_answer(sock: socket.socket) -> bool:
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def answered(port: int) -> bool:
    return http_get(f"http://{LOOPBACK}:{port}/", timeout=5.0) == (200, "ok")


def test_a_fault_in_the_protocols_own_code_drops_its_connection_not_the_loop(faulty_server, caplog) -> None:
    """A report that raises at accept, at a refusal (in data_received) and in the idle timer: each time that
    connection is dropped and the fault reported; the server answers the next connection, and nothing reached
    the event loop's exception handler."""
    port, events = faulty_server
    with caplog.at_level(logging.WARNING), socket.create_connection((LOOPBACK, port), timeout=5) as first:
        assert closed_without_answer(first)
        assert answered(port)
        with socket.create_connection((LOOPBACK, port), timeout=5) as too_large:
            too_large.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 2048 + b"\r\n\r\n")
            assert closed_without_answer(too_large)
        with socket.create_connection((LOOPBACK, port), timeout=5) as idle:
            assert closed_without_answer(idle)  # after idle_seconds
        assert answered(port)
    assert [callback for callback, _ in events.failures] == ["admit", "next_piece", "expire"], events.failures
    assert events.failures[1][1] == "refused failed: header_too_large"
    loop_errors = [r for r in caplog.records if r.name.startswith(("asyncio", "uvicorn"))]
    assert not loop_errors, [r.getMessage() for r in loop_errors]


class CountingEvents(FaultyEvents):
    """Events that count the connections the limited protocol holds open."""

    def __init__(self) -> None:
        super().__init__()
        self.opened_once = True
        self.open = 0

    def opened(self, connection: object, open_connections: int) -> HttpRefusal | None:
        assert open_connections == self.open, "the port's count and the transport's agree"
        self.open += 1
        return None

    def closed(self, connection: object) -> None:
        self.open -= 1


def test_a_websocket_upgrade_is_an_http_request_and_leaves_no_connection_counted(fresh_fallbacks) -> None:
    """The ports serve no websocket: an upgrade request is answered as a request, and its connection's end is seen,
    so upgrades cannot use up http_max_connections (uvicorn would hand an upgraded connection to another protocol)."""
    events = CountingEvents()
    limits = uvicorn_http.HttpLimits(max_head_bytes=1024, idle_seconds=5.0, max_connections=2)
    upgrade = (
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    with serving(uvicorn_http.protocol_settings(limits, events)) as port:
        for _ in range(3):
            with socket.create_connection((LOOPBACK, port), timeout=5) as sock:
                sock.sendall(upgrade)
                assert sock.recv(65536).startswith(b"HTTP/1.1 200 "), "upgraded, or refused"
        wait_for(lambda: events.open == 0, 5.0, "every connection seen closed")
        assert answered(port)


def test_a_request_answered_before_it_arrived_whole_leaves_its_connection_idle_timed(fresh_fallbacks) -> None:
    """The app answers before reading the body; the body ends later: from then on the connection is idle, and is
    closed ``idle_seconds`` after, as after any answer."""
    with (
        serving(uvicorn_http.protocol_settings(LIMITS, CountingEvents())) as port,
        socket.create_connection((LOOPBACK, port), timeout=5) as sock,
    ):
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        time.sleep(LIMITS.idle_seconds / 2)
        sock.sendall(b"hello")
        closed = seconds_until_closed(sock, time.monotonic(), LIMITS.idle_seconds + 2.0)
    assert closed is not None and closed <= LIMITS.idle_seconds + 0.5, closed


def connect_from(source: str, port: int) -> socket.socket:
    """A connection to ``port`` on LOOPBACK from the peer address ``source``."""
    sock = socket.socket()
    sock.settimeout(5)
    sock.bind((source, 0))
    sock.connect((LOOPBACK, port))
    return sock


def served(sock: socket.socket) -> bool:
    """Whether a GET on ``sock`` is answered 200."""
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    return sock.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_a_peer_past_its_share_is_answered_503_at_accept_counted_and_others_are_served() -> None:
    """The transport's events decide at accept (max_connections_per_peer 2 here): the third connection of one peer
    gets 503 and is closed before uvicorn sees it, counted peer_share; another peer is served; once the first
    peer closes one, it may open one again; a refused connection is never counted open."""
    metrics = Metrics()
    config = load_config({"max_connections_per_peer": "2"}, env={})
    events = HttpConnectionEvents(config, metrics, HttpRefusals(metrics), Port.HTTP_RPC)
    refused = {"reason": "peer_share"}

    with serving(uvicorn_http.protocol_settings(LIMITS, events)) as port, contextlib.ExitStack() as stack:
        first, second = (stack.enter_context(connect_from(LOOPBACK, port)) for _ in range(2))
        assert served(first) and served(second)
        with connect_from(LOOPBACK, port) as third:
            answer = third.recv(65536)
            assert answer.startswith(b"HTTP/1.1 503 ") and b"max_connections_per_peer" in answer, answer
            assert closed_without_answer(third)
        assert metrics.registry.get_sample_value("indexer_http_refused_total", refused) == 1
        other = stack.enter_context(connect_from(FLOOD_PEER, port))
        assert served(other), "another peer is served"
        first.close()
        wait_for(lambda: len(events.shares.held[LOOPBACK]) == 1, 5.0, "the closed connection released")
        assert served(stack.enter_context(connect_from(LOOPBACK, port)))
        assert metrics.registry.get_sample_value("indexer_http_refused_total", refused) == 1
        assert metrics.registry.get_sample_value("indexer_http_connections") == 3


def test_on_a_crowded_port_a_newcomer_displaces_the_latest_connection_of_the_peer_most_past_its_share(caplog) -> None:
    """http_max_connections 10 (crowded from 9), max_connections_per_peer 8: one peer takes 8, a second peer one;
    a third peer's connection finds the port crowded (a share of 8 // 3 = 2 each) and is served, the first peer's
    latest connection closed to make room, counted in indexer_peer_connections_closed_total and logged; the first
    peer's next connection is refused (503, peer_share)."""
    metrics = Metrics()
    config = load_config({"max_connections_per_peer": "8", "http_max_connections": "10"}, env={})
    events = HttpConnectionEvents(config, metrics, HttpRefusals(metrics), Port.HTTP_RPC)
    limits = uvicorn_http.HttpLimits(max_head_bytes=1024, idle_seconds=30.0, max_connections=10)

    with (
        serving(uvicorn_http.protocol_settings(limits, events)) as port,
        contextlib.ExitStack() as stack,
        caplog.at_level(logging.WARNING),
    ):
        first = [stack.enter_context(connect_from(LOOPBACK, port)) for _ in range(8)]
        assert all(served(sock) for sock in first)
        assert served(stack.enter_context(connect_from(FLOOD_PEER, port)))
        newcomer = stack.enter_context(connect_from("127.0.0.3", port))
        assert served(newcomer), "the newcomer is served"
        assert closed_without_answer(first[-1]), "the first peer's latest connection made room"
        assert all(served(sock) for sock in first[:-1])
        closed = {"port": "http_rpc"}
        assert metrics.registry.get_sample_value("indexer_peer_connections_closed_total", closed) == 1
        with connect_from(LOOPBACK, port) as again:
            assert again.recv(65536).startswith(b"HTTP/1.1 503 ")
        assert metrics.registry.get_sample_value("indexer_http_refused_total", {"reason": "peer_share"}) == 1
    lines = [r.getMessage() for r in caplog.records if "closed to make room" in r.getMessage()]
    assert lines and "port=http_rpc peer=127.0.0.1 held=7 count=1" in lines[0], lines


def test_protocol_errors_are_counted_and_logged_rate_limited(caplog) -> None:
    """The service's report of a fault: indexer_library_callback_errors_total{where="limited_protocol"}, and one
    line with the traceback, the step and the peer for the three."""
    metrics = Metrics()
    events = HttpConnectionEvents(load_config({}, env={}), metrics, HttpRefusals(metrics), Port.HTTP_RPC)
    labels = {"where": "limited_protocol"}
    assert metrics.registry.get_sample_value("indexer_library_callback_errors_total", labels) == 0
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            events.failed("next_piece", ("127.0.0.1", 5), RuntimeError("boom"))
    assert metrics.registry.get_sample_value("indexer_library_callback_errors_total", labels) == 3
    lines = [r for r in caplog.records if "library_callback_error" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is not None, [r.getMessage() for r in lines]
    message = lines[0].getMessage()
    assert "where=limited_protocol count=1 error=RuntimeError('boom') step=next_piece peer=http:127.0.0.1:5" in message


@pytest.fixture
def fallback_server(monkeypatch, fresh_fallbacks) -> Iterator[IndexerServer]:
    """The service in this process, started while uvicorn's httptools protocol lacks ``on_body``."""
    hide(monkeypatch, "HttpToolsProtocol.on_body")
    settings = {"backend": "numpy", "warmup_target": "none", "grpc_host": LOOPBACK, "http_host": LOOPBACK}
    settings |= {"shutdown_grace_seconds": "1", "http_max_header_bytes": "1024"}
    ports = {name: "0" for name in ("grpc_port", "http_port", "http_rpc_port", "health_port")}
    server = IndexerServer(load_config(settings | ports, env={}))
    server.start()
    try:
        wait_for(lambda: server.warmup_done.is_set(), 30.0, "warmup over")
        yield server
    finally:
        server.shutdown()


def test_on_the_fallback_the_service_serves_json_and_says_so(fallback_server) -> None:
    """The service starts on h11 with public settings: BuildChunk over HTTP JSON answers what the data plane
    computes, /metrics shows the fallback, GetWarmupStatus names it, and h11 still bounds a trailer (400)."""
    server = fallback_server
    connection = http.client.HTTPConnection(LOOPBACK, server.http_rpc_port, timeout=10)
    try:
        body = json_format.MessageToJson(SMALL_BUILD_CHUNK)
        connection.request("POST", BUILD_CHUNK_PATH, body=body, headers={"content-type": "application/json"})
        reply = connection.getresponse()
        status, text = reply.status, reply.read()
    finally:
        connection.close()
    assert status == 200, text
    expected = pb.BuildChunkResponse.FromString(server.plane.call("BuildChunk", SMALL_BUILD_CHUNK.SerializeToString()))
    assert json_format.Parse(text, pb.BuildChunkResponse()) == expected
    status, metrics = http_get(f"http://{LOOPBACK}:{server.http_port}/metrics")
    assert status == 200
    assert 'indexer_dependency_fallback{feature="limited_protocol",library="uvicorn"} 1.0' in metrics
    warmup = pb.GetWarmupStatusResponse.FromString(server.plane.call("GetWarmupStatus", b""))
    assert [(f.library, f.feature) for f in warmup.dependency_fallbacks] == [("uvicorn", "limited_protocol")]
    assert "HttpToolsProtocol.on_body" in warmup.dependency_fallbacks[0].detail
    # h11 refuses what it holds of an event still incomplete past h11_max_incomplete_event_size: here a trailer.
    with socket.create_connection((LOOPBACK, server.http_rpc_port), timeout=10) as sock:
        start = chunked_request("x", BUILD_CHUNK_PATH, b"{}", {"X-Padding": ""})[: -len(b"\r\n\r\n")]
        sock.sendall(start + b"a" * 4096)
        assert sock.recv(65536).startswith(b"HTTP/1.1 400 ")
