"""A request's head and trailers together stay within ``http_max_header_bytes`` on both HTTP ports (the chunked
framing lines counted too), and the idle and request timers fire on time while trailers flood the RPC port.
Real servers on 127.0.0.1, raw sockets (testkit/http1raw.py)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from google.protobuf import json_format

from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from testkit.harness import FAST_START, LOOPBACK, ServiceProcess, http_get, metric_total, scrape
from testkit.http1raw import chunked_request, huge_trailer, seconds_until_closed
from testkit.payloads import BUILD_CHUNK_PATH, SMALL_BUILD_CHUNK

MiB = 2**20
LIMIT = 1024  # http_max_header_bytes of the module's server
IDLE = 2.0  # http_idle_timeout_seconds of the timer test's server
JSON_REQUEST = json_format.MessageToJson(SMALL_BUILD_CHUNK).encode()


@pytest.fixture(scope="module")
def server() -> Iterator[ServiceProcess]:
    with ServiceProcess(*FAST_START, "--http-max-header-bytes", str(LIMIT)) as process:
        yield process


def exchange(port: int, data: bytes, timeout: float = 10.0) -> tuple[list[int], bytes, bool]:
    """``data`` sent on one connection; (the statuses of every answer, the last answer's body, whether the server
    closed the connection), reading until it closes or is quiet for a second."""
    received = b""
    closed = False
    with socket.create_connection((LOOPBACK, port), timeout=timeout) as sock:
        # Refused before all of it went: the answer is already on its way.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        sock.settimeout(1.0)
        try:
            while piece := sock.recv(65536):
                received += piece
            closed = True
        except TimeoutError:
            pass
        except ConnectionResetError:
            closed = True
    statuses, body = [], b""
    while received.startswith(b"HTTP/1.1 "):
        head, _, rest = received.partition(b"\r\n\r\n")
        statuses.append(int(head.split(b" ", 2)[1]))
        length = next(
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        body, received = rest[:length], rest[length:]
    return statuses, body, closed


def refused_count(server: ServiceProcess) -> float:
    return metric_total(scrape(server.http_url), "indexer_http_refused_total", reason="header_too_large")


def assert_answered(statuses: list[int], body: bytes) -> None:
    assert statuses == [200], (statuses, body)
    answer = json_format.Parse(body, pb.BuildChunkResponse())
    assert answer.metadata.total_seq_lens == 3, body


def assert_431(statuses: list[int], body: bytes, closed: bool) -> None:
    assert statuses == [431] and closed, (statuses, body, closed)
    error = json.loads(body)
    assert (
        error["code"] == "RESOURCE_EXHAUSTED" and f"request head and trailers above {LIMIT} bytes" in error["message"]
    )


def test_trailers_within_the_limit_are_served(server) -> None:
    """A head and trailers that fit together: answered, the trailers no part of the request."""
    request = chunked_request("x", BUILD_CHUNK_PATH, JSON_REQUEST, {"X-Checksum": "a" * 300, "X-Other": "b" * 100})
    assert_answered(*exchange(server.http_rpc_port, request)[:2])


def test_head_and_trailers_count_together(server) -> None:
    """Each under the limit, together over it: 431, closed, counted and logged, the app never called."""
    before = refused_count(server)
    padding = {"X-Padding": "a" * 500}
    request = chunked_request("x", BUILD_CHUNK_PATH, JSON_REQUEST, padding, headers=padding)
    assert len(request.partition(b"\r\n\r\n")[0]) < LIMIT
    assert_431(*exchange(server.http_rpc_port, request))
    assert refused_count(server) == before + 1
    assert "http refused reason=header_too_large" in server.log()


def test_the_chunk_framing_lines_count_too(server) -> None:
    """A body of 300 one-byte chunks: its 1,500 bytes of framing ("1\\r\\n", "\\r\\n") are over the limit."""
    head, _, _ = chunked_request("x", BUILD_CHUNK_PATH, b"", {}).partition(b"\r\n\r\n")
    request = head + b"\r\n\r\n" + b"".join(b"1\r\n" + bytes([c]) + b"\r\n" for c in b" " * 300) + b"0\r\n\r\n"
    assert_431(*exchange(server.http_rpc_port, request))


@pytest.mark.parametrize("port", ["http_port", "http_rpc_port"])
def test_pipelined_requests_each_within_the_limit_are_all_answered(server, port) -> None:
    """Every request's count starts at its own first byte: three heads of 700 bytes in one send (2,100 bytes
    together) are three answers."""
    head = f"GET /livez HTTP/1.1\r\nHost: x\r\nX-Padding: {'a' * 650}\r\n\r\n".encode()
    assert 650 < len(head) < LIMIT
    statuses, _, _ = exchange(getattr(server, port), head * 3)
    assert statuses == [200, 200, 200] if port == "http_port" else [404, 404, 404], statuses


def test_a_huge_trailer_is_refused_early_and_holds_no_memory(server) -> None:
    """The issue's attack: a 64 MiB trailer field streamed on http_rpc_port. Refused early (431, or closed
    before the client read it), counted; the server's resident memory does not grow by anything like the
    trailer; a request on another connection is answered meanwhile."""
    request = chunked_request("x", BUILD_CHUNK_PATH, JSON_REQUEST, {})
    assert_answered(*exchange(server.http_rpc_port, request)[:2])  # the code paths loaded before the baseline
    before, baseline = refused_count(server), server.rss_bytes()
    peak, done = [baseline], threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], server.rss_bytes())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        report = huge_trailer(LOOPBACK, server.http_rpc_port, BUILD_CHUNK_PATH, JSON_REQUEST, 64 * MiB, 30.0)
        answered = exchange(server.http_rpc_port, request)
    finally:
        done.set()
        sampler.join()
    assert report.status == 431 or (report.status is None and report.closed_by_server), report
    assert report.header_bytes_sent < 16 * MiB and report.seconds < 5.0, report  # the kernel's buffers, no more
    assert peak[0] - baseline < 8 * MiB, f"RSS {baseline / MiB:.0f} -> {peak[0] / MiB:.0f} MiB"
    assert_answered(*answered[:2])
    assert refused_count(server) == before + 1


def test_timers_fire_on_time_while_trailers_flood(tmp_path) -> None:
    """With ``http_idle_timeout_seconds`` 2 and two connections at a time streaming 64 MiB trailers on the RPC
    port: a connection that sends nothing, one sending its head a byte at a time, and one sending its trailer a
    byte at a time are each closed 2 s after it connected or sent its first byte, at most 1 s late."""
    with ServiceProcess(*FAST_START, "--http-idle-timeout-seconds", str(IDLE), workdir=tmp_path) as server:
        port = server.http_rpc_port
        stop = threading.Event()
        floods = [0, 0]

        def flood(index: int) -> None:
            while not stop.is_set():
                huge_trailer(LOOPBACK, port, BUILD_CHUNK_PATH, JSON_REQUEST, 64 * MiB, 10.0)
                floods[index] += 1

        attackers = [threading.Thread(target=flood, args=(i,)) for i in range(2)]
        for attacker in attackers:
            attacker.start()
        watched: dict[str, tuple[socket.socket, bytes, float]] = {}
        closed_after: dict[str, float | None] = {}
        try:
            time.sleep(0.5)
            request = chunked_request("x", BUILD_CHUNK_PATH, JSON_REQUEST, {"X-Slow": "a" * 200})
            slow = {
                "idle": b"",
                "slow head": b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200,
                "slow trailer": request[: request.index(b"X-Slow: ")] + b"a" * 200,
            }
            for name, data in slow.items():
                sock = socket.create_connection((LOOPBACK, port), timeout=5)
                first = data[: len(data) - 200]
                sock.sendall(first)
                watched[name] = (sock, data[len(first) :], time.monotonic())
            begin = time.monotonic()
            while len(closed_after) < len(watched) and time.monotonic() - begin < IDLE + 3.0:
                for name, (sock, rest, since) in watched.items():
                    if name in closed_after:
                        continue
                    if (seconds := seconds_until_closed(sock, since, 0.0)) is not None:
                        closed_after[name] = seconds
                    elif rest:
                        watched[name] = (sock, rest[1:], since)
                        with contextlib.suppress(OSError):
                            sock.sendall(rest[:1])
                time.sleep(0.05)
            healthy = http_get(f"{server.http_url}/livez", timeout=5.0)
        finally:
            stop.set()
            for attacker in attackers:
                attacker.join()
            for sock, _, _ in watched.values():
                sock.close()
        assert sum(floods) >= 4, floods  # the flood ran throughout
        assert set(closed_after) == set(watched), f"still open after {IDLE + 3.0} s: {closed_after}"
        for seconds in closed_after.values():
            assert IDLE - 0.1 <= seconds <= IDLE + 1.0, closed_after
        assert healthy[0] == 200, healthy
        assert metric_total(scrape(server.http_url), "indexer_http_refused_total", reason="idle_timeout") >= 3
