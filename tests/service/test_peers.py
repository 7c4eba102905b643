"""The per-peer connection cap (service/overload/peers.py) on real sockets in this process: its connections read
as the server reads them (netlink sock_diag, or /proc where the kernel refuses it), a peer's connections past the
cap shut down, those that came since the last check first (their owner sees the end), other peers and other ports
untouched, a descriptor reused by another connection never shut, every closing counted."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import sys
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter

from indexer_service.service.overload import sockdiag
from indexer_service.service.overload.peers import (
    CHECK_SECONDS,
    CHECK_SHARE,
    CUTTING_CHECK_SECONDS,
    MAX_CHECK_SECONDS,
    PeerCap,
    established,
    peer_of,
    proc_address,
    shut_down,
    socket_inodes,
)
from indexer_service.service.reasons import Port

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")


def closed_counter() -> Counter:
    return Counter("closed", "test", ["port"], registry=CollectorRegistry())


@contextmanager
def listener() -> Iterator[socket.socket]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    with server:
        yield server


def connect(stack: ExitStack, server: socket.socket, source: str) -> tuple[socket.socket, socket.socket]:
    """A connection from ``source``: (the client's end, the accepted end this process serves)."""
    client = stack.enter_context(socket.socket())
    client.bind((source, 0))
    client.connect(server.getsockname())
    accepted = stack.enter_context(server.accept()[0])
    return client, accepted


def ended(client: socket.socket) -> bool:
    """Whether the server side shut the connection down (the client reads the end of the stream: at once over
    loopback, as the shutdown happened before this is asked)."""
    client.settimeout(0.2)
    try:
        return client.recv(1) == b""
    except TimeoutError:
        return False


@pytest.mark.parametrize(
    ("written", "address"),
    [
        ("0100007F", "127.0.0.1"),
        ("0200007F", "127.0.0.2"),
        ("00000000000000000000000001000000", "::1"),
        ("0000000000000000FFFF00000300007F", "127.0.0.3"),  # an IPv4 peer of a dual-stack listener
        ("B80D0120000000000000000001000000", "2001:db8::1"),
    ],
)
def test_addresses_read_as_proc_writes_them(written: str, address: str) -> None:
    if sys.byteorder != "little":
        pytest.skip("the table above is written as a little-endian host writes it")
    assert str(proc_address(written)) == address


def test_tables_keep_established_connections_to_the_ports_asked(tmp_path: Path) -> None:
    table = tmp_path / "tcp"
    table.write_text(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0100007F:C351 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 100 1\n"
        "   1: 0100007F:C351 0200007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 101 1\n"
        "   2: 0100007F:C351 0300007F:9C41 06 00000000:00000000 00:00000000 00000000     0        0 0 1\n"
        "   3: 0100007F:1F90 0200007F:9C42 01 00000000:00000000 00:00000000 00000000     0        0 102 1\n"
    )
    # The listener (0A) and a TIME_WAIT (06) are not connections a peer holds; port 8080 was not asked for.
    rows = established([0xC351], [str(table), str(tmp_path / "missing")])
    assert rows == [(0xC351, 101, ipaddress.ip_address("127.0.0.2"))]


# Each reader of the established connections: netlink sock_diag with /proc as its fallback (the default), /proc.
READERS = [pytest.param(None, id="sock_diag"), pytest.param(established, id="proc")]


@pytest.mark.parametrize("read", READERS)
def test_a_peers_connections_past_the_cap_are_shut_down_those_that_came_since_the_last_check_first(read) -> None:
    counter = closed_counter()
    with listener() as server, listener() as other_port, ExitStack() as stack:
        port = server.getsockname()[1]
        cap = PeerCap(2, {port: Port.GRPC}, counter, read=read)
        held = [connect(stack, server, "127.0.0.2") for _ in range(2)]
        assert cap.check(fds=len(os.listdir("/proc/self/fd"))) == 0  # at the cap: nothing cut, both seen
        flood = [connect(stack, server, "127.0.0.2") for _ in range(3)]
        neighbour = [connect(stack, server, "127.0.0.3") for _ in range(2)]
        elsewhere = [connect(stack, other_port, "127.0.0.2") for _ in range(4)]  # a port not capped here
        assert cap.check(fds=len(os.listdir("/proc/self/fd"))) == 3
        # The kernel hands inodes out in blocks per CPU: not their order, the last check decides what is new.
        assert [ended(client) for client, _ in held + flood] == [False, False, True, True, True]
        assert not any(ended(client) for client, _ in neighbour + elsewhere)
        assert counter.labels(port="grpc")._value.get() == 3
        assert cap.check(fds=len(os.listdir("/proc/self/fd"))) == 0  # the shut ones are no longer established


@pytest.mark.parametrize(
    ("address", "peer"),
    [("10.0.3.7", "10.0.3.7"), ("2001:db8::1", "2001:db8::/64"), ("2001:db8::ffff:1:2", "2001:db8::/64")],
)
def test_an_ipv6_peer_is_its_64(address: str, peer: str) -> None:
    assert peer_of(ipaddress.ip_address(address)) == peer


def test_nothing_is_read_while_the_process_holds_fewer_descriptors_than_the_cap() -> None:
    def unexpected(*args: object) -> list:
        raise AssertionError("read the connections although no peer can be over the cap")

    assert PeerCap(256, {1: Port.GRPC}, closed_counter(), read=unexpected).check(fds=100) == 0
    assert PeerCap(0, {1: Port.GRPC}, closed_counter(), read=unexpected).check(fds=100_000) == 0


def test_where_the_kernel_refuses_sock_diag_the_cap_reads_proc_and_says_so_once_at_start(monkeypatch, caplog) -> None:
    """A kernel without sock_diag (gVisor, a seccomp profile, no inet_diag module): one WARNING when the cap
    starts, then /proc at every check, cutting as before."""

    def refused(family: int, kind: int, protocol: int) -> socket.socket:
        raise OSError(errno.EPROTONOSUPPORT, "Protocol not supported")

    monkeypatch.setattr(sockdiag, "socket", SimpleNamespace(**{**vars(socket), "socket": refused}))
    proc_reads = []

    def proc(ports: Iterable[int]) -> list:
        proc_reads.append(sorted(ports))
        return established(ports)

    monkeypatch.setattr("indexer_service.service.overload.peers.established", proc)
    counter = closed_counter()
    with listener() as server, ExitStack() as stack:
        port = server.getsockname()[1]
        cap = PeerCap(1, {port: Port.GRPC}, counter)
        cap.start()
        cap.stop()
        fallback = [r.getMessage() for r in caplog.records if "sock_diag" in r.getMessage()]
        assert len(fallback) == 1
        assert "/proc/net/tcp" in fallback[0]
        assert "Protocol not supported" in fallback[0]
        clients = [connect(stack, server, "127.0.0.2")[0] for _ in range(3)]
        assert cap.check(fds=len(os.listdir("/proc/self/fd"))) == 2
        assert [ended(client) for client in clients].count(True) == 2
        assert len([r for r in caplog.records if "sock_diag" in r.getMessage()]) == 1  # said once
        assert proc_reads == [[port], [port]]  # the probe at start, then the check


def test_a_descriptor_that_now_holds_another_connection_is_not_shut() -> None:
    with listener() as server, ExitStack() as stack:
        client, accepted = connect(stack, server, "127.0.0.2")
        inode = os.fstat(accepted.fileno()).st_ino
        assert socket_inodes()[inode] == accepted.fileno()
        assert not shut_down(accepted.fileno(), inode + 1)  # what the scan saw is gone, the number reused
        assert not ended(client)
        assert shut_down(accepted.fileno(), inode)
        assert ended(client)
        assert os.fstat(accepted.fileno()).st_ino == inode  # the descriptor itself stays open: its owner closes it


def test_checks_come_sooner_while_a_flood_is_being_cut(monkeypatch) -> None:
    """A peer that reconnects as fast as it is cut takes the port's free room between two checks: while the last
    check cut something the next comes after CUTTING_CHECK_SECONDS, else after CHECK_SECONDS."""
    cap = PeerCap(2, {1: Port.GRPC}, closed_counter())
    cut = iter([0, 5, 3, 0, 0])
    monkeypatch.setattr(cap, "check", lambda fds: next(cut))
    waits: list[float] = []

    class Stop:
        def wait(self, seconds: float) -> bool:
            waits.append(seconds)
            return len(waits) > 5  # stop after five checks

    monkeypatch.setattr(cap, "_stop", Stop())
    cap._run()
    assert waits == [
        CHECK_SECONDS,
        CHECK_SECONDS,
        CUTTING_CHECK_SECONDS,
        CUTTING_CHECK_SECONDS,
        CHECK_SECONDS,
        CHECK_SECONDS,
    ]


def test_a_costly_check_waits_longer_for_the_next(monkeypatch) -> None:
    """A check that read huge tables (TIME_WAIT sockets by the hundred thousand) takes at most CHECK_SHARE of
    its thread's time: 0.2 s spent, the next check 0.2 / CHECK_SHARE s later, whether or not it cut anything; 0.5 s
    spent reading and 0.3 s shutting connections down, the same (the shutdowns are not counted); 1 s spent
    reading, the next after MAX_CHECK_SECONDS all the same."""
    cap = PeerCap(2, {1: Port.GRPC}, closed_counter())
    cut = iter([(5, 0.0), (0, 0.0), (5, 0.3), (0, 0.0)])

    def check(fds: int) -> int:
        closed, cap._cutting_seconds = next(cut)
        return closed

    monkeypatch.setattr(cap, "check", check)
    clock = iter([10.0, 10.2, 20.0, 20.2, 30.0, 30.5, 40.0, 41.0])
    monkeypatch.setattr("indexer_service.service.overload.peers._clock", lambda: next(clock))
    waits: list[float] = []

    class Stop:
        def wait(self, seconds: float) -> bool:
            waits.append(seconds)
            return len(waits) > 4

    monkeypatch.setattr(cap, "_stop", Stop())
    cap._run()
    assert waits == [
        CHECK_SECONDS,
        pytest.approx(0.2 / CHECK_SHARE),
        pytest.approx(0.2 / CHECK_SHARE),
        pytest.approx(0.2 / CHECK_SHARE),
        MAX_CHECK_SECONDS,
    ]
