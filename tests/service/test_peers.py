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
import time
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from indexer_service.service.observability.metrics import PeerCapMetrics
from indexer_service.service.overload import listenfilter, sockdiag
from indexer_service.service.overload import peers as peers_module
from indexer_service.service.overload.peers import (
    CHECK_SECONDS,
    CHECK_SHARE,
    CUTTING_CHECK_SECONDS,
    CUTTING_CHECK_SHARE,
    FLOOD_STEP,
    MAX_CHECK_SECONDS,
    CheckSchedule,
    PeerCap,
    PortShares,
    SocketTables,
    established,
    peer_of,
    peer_of_host,
    proc_address,
    shut_down,
    socket_inodes,
)
from indexer_service.service.reasons import Port
from testkit.harness import poll
from tests.service.sockets_support import listener

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")


def cap_metrics() -> PeerCapMetrics:
    return PeerCapMetrics(CollectorRegistry())


def closed(metrics: PeerCapMetrics, port: str = "grpc") -> float:
    return metrics.peer_connections_closed_total.labels(port=port)._value.get()


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


# How the connections are read: netlink sock_diag with /proc as its fallback (the default), /proc only.
READERS = [pytest.param(True, id="sock_diag"), pytest.param(False, id="proc")]


@pytest.mark.parametrize("netlink", READERS)
def test_a_peers_connections_past_the_cap_are_shut_down_those_that_came_since_the_last_check_first(netlink) -> None:
    metrics = cap_metrics()
    with listener() as server, listener() as other_port, ExitStack() as stack:
        port = server.getsockname()[1]
        cap = PeerCap(2, {port: Port.GRPC}, metrics, tables=SocketTables(netlink))
        held = [connect(stack, server, "127.0.0.2")]
        assert cap.check(fds=len(os.listdir("/proc/self/fd"))) == 0  # under the cap: nothing cut, seen
        flood = [connect(stack, server, "127.0.0.2") for _ in range(4)]  # all come before the next check
        neighbour = [connect(stack, server, "127.0.0.3") for _ in range(2)]
        elsewhere = [connect(stack, other_port, "127.0.0.2") for _ in range(4)]  # a port not capped here
        assert cap.check(fds=len(os.listdir("/proc/self/fd"))) == 3
        # The kernel hands inodes out in blocks per CPU: not their order, the last check decides what is new.
        assert not ended(held[0][0])
        assert [ended(client) for client, _ in flood].count(True) == 3
        assert not any(ended(client) for client, _ in neighbour + elsewhere)
        assert closed(metrics) == 3
        assert cap.check(fds=len(os.listdir("/proc/self/fd"))) == 0  # the shut ones are no longer established


def attempt(server: socket.socket, source: str) -> bool:
    """Whether a new connection from ``source`` completes (a dropped SYN is sent again only after 1 s)."""
    with socket.socket() as client:
        client.bind((source, 0))
        client.settimeout(0.4)
        try:
            client.connect(server.getsockname())
        except TimeoutError:
            return False
        server.accept()[0].close()
        return True


@pytest.mark.parametrize("netlink", READERS)
def test_a_peer_at_the_cap_has_its_new_connections_dropped_before_accept_until_it_holds_fewer(netlink, caplog) -> None:
    """At the cap, the listener's filter drops the peer's SYNs (its connections are never accepted, so never need
    cutting), counted by port, the peer named in a gauge and a log line; other peers connect as before; once it
    holds fewer than the cap, its new connections are accepted again."""
    metrics = cap_metrics()
    with listener() as server, ExitStack() as stack:
        port = server.getsockname()[1]
        cap = PeerCap(2, {port: Port.GRPC}, metrics, tables=SocketTables(netlink))
        held = [connect(stack, server, "127.0.0.2") for _ in range(2)]
        assert cap.check(fds=len(os.listdir("/proc/self/fd"))) == 0
        assert metrics.peers_at_connection_cap.labels(port="grpc")._value.get() == 1
        assert not attempt(server, "127.0.0.2")
        assert attempt(server, "127.0.0.3")
        cap.check(fds=len(os.listdir("/proc/self/fd")))
        dropped = metrics.connections_dropped_before_accept_total.labels(port="grpc")._value.get()
        assert dropped == 1, dropped
        assert closed(metrics) == 0
        assert any(
            "new connections dropped before accept port=grpc peers=1 worst_peer=127.0.0.2 held=2" in r.getMessage()
            for r in caplog.records
        )
        held[0][0].close()
        held[0][1].close()
        assert cap.check(fds=len(os.listdir("/proc/self/fd"))) == 0
        assert metrics.peers_at_connection_cap.labels(port="grpc")._value.get() == 0
        assert attempt(server, "127.0.0.2")


@pytest.mark.parametrize("netlink", READERS)
def test_a_crowded_port_holds_each_peer_to_its_share_so_a_newcomer_finds_room(netlink, caplog) -> None:
    """Many peers, each far under max_connections_per_peer, fill 90 % of the port's own cap (here 10): the port is
    crowded, each peer is held to its share of 80 % of the cap (8 over 4 peers: 2), those past it shut down and its
    new connections dropped before accept, while a peer that holds none connects; once the port is under 70 % of its
    cap the shares are lifted."""
    metrics = cap_metrics()
    with listener() as server, ExitStack() as stack:
        port = server.getsockname()[1]
        cap = PeerCap(256, {port: Port.GRPC}, metrics, tables=SocketTables(netlink), limits={Port.GRPC: 10})
        crowd = {f"127.0.0.{n}": [connect(stack, server, f"127.0.0.{n}") for _ in range(3)] for n in range(2, 6)}
        assert cap.check(fds=len(os.listdir("/proc/self/fd"))) == 4
        assert [[ended(client) for client, _ in held].count(True) for held in crowd.values()] == [1, 1, 1, 1]
        assert metrics.peers_at_connection_cap.labels(port="grpc")._value.get() == 4
        assert not attempt(server, "127.0.0.2")
        assert attempt(server, "127.0.0.9")
        said = [r.getMessage() for r in caplog.records]
        assert any(
            "port crowded: each peer held to its share port=grpc connections=12 limit=10 peers=4 share=2" in m
            for m in said
        ), said
        for client, accepted in crowd["127.0.0.2"] + crowd["127.0.0.3"]:
            client.close()
            accepted.close()
        assert cap.check(fds=len(os.listdir("/proc/self/fd"))) == 0  # 4 left of 10: no longer crowded
        assert metrics.peers_at_connection_cap.labels(port="grpc")._value.get() == 0
        assert attempt(server, "127.0.0.2")


def test_a_listener_closed_meanwhile_is_forgotten_not_an_error() -> None:
    """Its owner closed it (a server stopping) or its number now holds another file: the check goes on, and looks
    for the port's listeners again."""
    metrics = cap_metrics()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    port = server.getsockname()[1]
    cap = PeerCap(2, {port: Port.GRPC}, metrics)
    cap.check(fds=1)
    assert [fd for fd, _ in cap._listeners[port]] == [server.fileno()]
    server.close()
    assert cap.check(fds=1) == 0
    assert port not in cap._listeners


def test_on_a_port_whose_listeners_are_all_its_own_the_filter_goes_on_before_the_descriptors_are_listed(
    monkeypatch,
) -> None:
    """Every connection of such a port is the process's: the sock_diag reading alone names the peer at its cap, and
    the filter is set before the listing of descriptors (an fstat each) that the cut needs."""
    order: list[str] = []
    real_attach, real_inodes = listenfilter.attach, peers_module.socket_inodes
    monkeypatch.setattr(listenfilter, "attach", lambda *args: order.append("filter") or real_attach(*args))
    monkeypatch.setattr(peers_module, "socket_inodes", lambda *args: order.append("listing") or real_inodes(*args))
    with listener() as server, ExitStack() as stack:
        port = server.getsockname()[1]
        cap = PeerCap(2, {port: Port.GRPC}, cap_metrics())
        cap.check(fds=1)  # finds its listener
        order.clear()
        [connect(stack, server, "127.0.0.2") for _ in range(3)]
        assert cap.check(fds=len(os.listdir("/proc/self/fd"))) == 1
        assert order == ["filter", "listing"], order
        assert not attempt(server, "127.0.0.2")


def test_a_listener_other_processes_share_is_not_filtered() -> None:
    """With workers, the HTTP ports' listener is the supervisor's, inherited by each worker: a worker's filter
    would replace another's, so on such a port a peer past the cap is only cut."""
    metrics = cap_metrics()
    with listener() as server, ExitStack() as stack:
        port = server.getsockname()[1]
        cap = PeerCap(1, {port: Port.HTTP}, metrics, shared=[port])
        [connect(stack, server, "127.0.0.2") for _ in range(2)]
        assert cap.check(fds=len(os.listdir("/proc/self/fd"))) == 1
        assert attempt(server, "127.0.0.2")
        assert metrics.peers_at_connection_cap.labels(port="http")._value.get() == 0


def test_where_the_kernel_refuses_a_filter_the_cap_says_so_once_and_cuts(monkeypatch, caplog) -> None:
    def refused(fd: int, inode: int, program: bytes) -> None:
        raise OSError(errno.ENOPROTOOPT, "Protocol not available")

    monkeypatch.setattr("indexer_service.service.overload.listenfilter.attach", refused)
    metrics = cap_metrics()
    with listener() as server, ExitStack() as stack:
        port = server.getsockname()[1]
        cap = PeerCap(1, {port: Port.GRPC}, metrics)
        [connect(stack, server, "127.0.0.2") for _ in range(2)]
        assert cap.check(fds=len(os.listdir("/proc/self/fd"))) == 1
        connect(stack, server, "127.0.0.2")
        assert cap.check(fds=len(os.listdir("/proc/self/fd"))) == 1
        said = [r.getMessage() for r in caplog.records if "cannot have the kernel drop" in r.getMessage()]
        assert len(said) == 1 and "Protocol not available" in said[0], said


@pytest.mark.parametrize(
    ("address", "peer"),
    [("10.0.3.7", "10.0.3.7"), ("2001:db8::1", "2001:db8::/64"), ("2001:db8::ffff:1:2", "2001:db8::/64")],
)
def test_an_ipv6_peer_is_its_64(address: str, peer: str) -> None:
    assert peer_of(ipaddress.ip_address(address)) == peer


@pytest.mark.parametrize(
    ("host", "peer"),
    [
        ("10.0.3.7", "10.0.3.7"),
        ("::ffff:10.0.3.7", "10.0.3.7"),
        ("fe80::1%eth0", "fe80::/64"),
        ("2001:db8::1", "2001:db8::/64"),
        ("", None),
        ("/run/indexer.sock", None),
    ],
)
def test_a_peer_name_is_counted_as_its_address_would_be(host: str, peer: str | None) -> None:
    assert peer_of_host(host) == peer


class Arrivals:
    """Connections arriving at a PortShares one at a time, counted as the HTTP protocol counts them: a displaced
    connection closes at once."""

    def __init__(self, shares: PortShares) -> None:
        self.shares, self.open, self.serial = shares, 0, 0
        self.displaced: list[tuple[str, int]] = []

    def arrive(self, peer: str) -> bool:
        self.serial += 1
        taken, displaced = self.shares.admit(peer, (peer, self.serial), self.open)
        self.open += taken
        if displaced is not None:
            self.displaced.append(displaced)
            self.open -= 1
        return taken

    def leave(self, peer: str, count: int) -> None:
        for connection in list(self.shares.held[peer])[:count]:
            self.shares.release(connection)
            self.open -= 1


def test_at_accept_a_peer_gets_the_cap_then_on_a_crowded_port_its_share_and_a_newcomer_always_room() -> None:
    """PortShares, the rule applied as connections arrive (the HTTP ports): the cap per peer; once the port's
    connections reach 90 % of its limit, each peer's share of 80 % of it over the peers holding connections (a
    newcomer counted among them), and a connection within its share displaces the latest of the peer most past
    its share, so the port stays at 90 % while more of its connections than its peers are there; crowded until
    under 70 %."""
    port = Arrivals(PortShares(cap=4, limit=20))  # crowded from 18 open until under 14; a share is 16 // peers
    assert [port.arrive("a") for _ in range(5)] == [True] * 4 + [False]  # the cap
    for peer in "bcd":
        assert all(port.arrive(peer) for _ in range(4))
    assert [port.arrive("e") for _ in range(4)] == [True, True, True, False]  # crowded at 18: 5 peers, 3 each
    assert port.displaced == [("a", 4)], "the third made room: the latest of the first peer holding the most"
    assert port.open == 18 and port.shares.crowded
    for newcomer in "fghijklm":  # while the port's 18 have fewer peers than that, someone is past the share
        assert port.arrive(newcomer), "a newcomer always gets one"
        assert port.open == 18, "each displaces one: the port stays at 90 % of its cap"
    assert {peer: len(held) for peer, held in port.shares.held.items()} == dict.fromkeys("abcde", 2) | dict.fromkeys(
        "fghijklm", 1
    )
    assert not port.arrive("b"), "a peer at its share gets nothing more"
    port.shares.release(("a", 4))  # its end, told after it was displaced: nothing more to release
    port.leave("f", 1), port.leave("g", 1), port.leave("h", 1), port.leave("i", 1)
    assert port.open == 14 and port.arrive("f") and port.shares.crowded  # 14 is 70 %: still crowded
    port.leave("f", 1), port.leave("j", 1)
    assert port.open == 13 and port.arrive("f") and not port.shares.crowded  # under 70 %: the cap again
    assert "g" not in port.shares.held, "a peer holding none is forgotten"


def test_at_accept_no_cap_and_no_ip_peer_are_never_refused() -> None:
    assert all(PortShares(cap=0, limit=2).admit("a", n, 100) == (True, None) for n in range(10))
    shares = PortShares(cap=1, limit=2)
    assert all(shares.admit(None, n, 100) == (True, None) for n in range(10)) and not shares.held
    shares.release(0)  # never counted: nothing to release


def test_nothing_is_read_while_the_process_holds_fewer_descriptors_than_the_cap() -> None:
    class Unexpected(SocketTables):
        def established(self, ports: Iterable[int]) -> list:
            raise AssertionError("read the connections although no peer can be over the cap")

    assert PeerCap(256, {1: Port.GRPC}, cap_metrics(), tables=Unexpected()).check(fds=100) == 0
    assert PeerCap(0, {1: Port.GRPC}, cap_metrics(), tables=Unexpected()).check(fds=100_000) == 0


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
    metrics = cap_metrics()
    with listener() as server, ExitStack() as stack:
        port = server.getsockname()[1]
        cap = PeerCap(1, {port: Port.GRPC}, metrics, tables=SocketTables())
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
        descriptors = len(os.listdir("/proc/self/fd"))
        assert not shut_down(accepted.fileno(), inode + 1)  # what the scan saw is gone, the number reused
        assert len(os.listdir("/proc/self/fd")) == descriptors  # its duplicate closed too
        assert not ended(client)
        assert shut_down(accepted.fileno(), inode)
        assert ended(client)
        assert os.fstat(accepted.fileno()).st_ino == inode  # the descriptor itself stays open: its owner closes it


def test_checks_come_sooner_while_a_flood_is_being_cut_and_at_once_when_descriptors_jump() -> None:
    """A peer that reconnects as fast as it is cut takes the port's free room between two checks: while the last
    check cut something the next is due after CUTTING_CHECK_SECONDS, else after CHECK_SECONDS; and a flood's first
    connections (FLOOD_STEP more descriptors than at the last check) bring the next check forward, as soon as the
    last one's cost share allows (a check that read nothing at once; one that spent 5 ms 50 ms after it)."""
    schedule = CheckSchedule()
    assert schedule.is_due(0.0, 10)
    schedule.checked(0.0, 10, spent=0.0001, closed=0)
    assert not schedule.is_due(CHECK_SECONDS - 0.01, 10 + FLOOD_STEP - 1)
    assert schedule.is_due(CHECK_SECONDS, 10)
    assert schedule.is_due(0.002, 10 + FLOOD_STEP)
    schedule.checked(0.5, 10, spent=0.005, closed=0)
    assert not schedule.is_due(0.5 + 0.005 / CHECK_SHARE - 0.001, 10 + FLOOD_STEP)
    assert schedule.is_due(0.5 + 0.005 / CHECK_SHARE, 10 + FLOOD_STEP)
    schedule.checked(1.0, 500, spent=0.001, closed=5)
    assert not schedule.is_due(1.0 + CUTTING_CHECK_SECONDS - 0.01, 500)
    assert schedule.is_due(1.0 + CUTTING_CHECK_SECONDS, 300)


@pytest.mark.parametrize(
    ("spent", "closed", "after"),
    [
        (0.2, 0, 0.2 / CHECK_SHARE),
        (0.2, 5, 0.2 / CUTTING_CHECK_SHARE),
        (1.0, 0, MAX_CHECK_SECONDS),
    ],
    ids=["costly", "costly-while-cutting", "costliest"],
)
def test_a_costly_check_waits_longer_for_the_next_whatever_the_descriptors(spent, closed, after) -> None:
    """A check that read huge tables (TIME_WAIT sockets by the hundred thousand) takes at most CHECK_SHARE of its
    thread's time, or CUTTING_CHECK_SHARE after one that cut (a flood is being cut), however fast descriptors come;
    MAX_CHECK_SECONDS at most."""
    schedule = CheckSchedule()
    schedule.checked(10.0, 1000, spent=spent, closed=closed)
    assert not schedule.is_due(10.0 + after - 0.01, 100_000)
    assert schedule.is_due(10.0 + after, 1000)


def test_a_burst_of_connections_wakes_the_checking_thread_between_its_regular_checks(monkeypatch) -> None:
    """No poll in between: the regular checks are pushed out of the way (every 30 s here), and a burst of
    connections to the process's own listener (accepted here, as gRPC core would) still brings a check within
    moments, with the descriptors the burst added; with no connection coming, no check."""
    monkeypatch.setattr("indexer_service.service.overload.peers.CHECK_SECONDS", 30.0)
    checks: list[int] = []
    with listener() as server, ExitStack() as stack:
        port = server.getsockname()[1]
        cap = PeerCap(2, {port: Port.GRPC}, cap_metrics())
        real_check = cap.check
        monkeypatch.setattr(cap, "check", lambda fds: checks.append(fds) or real_check(fds))
        cap.start()
        stack.callback(cap.stop)
        assert poll(lambda: len(checks) == 1 and port in cap._listeners, 5.0)  # the first, at once
        time.sleep(0.3)
        assert len(checks) == 1  # nothing came, nothing woke it
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(FLOOD_STEP + 8):
            connect(stack, server, "127.0.0.1")
        assert poll(lambda: len(checks) >= 2, 5.0), checks
        assert checks[1] >= before + FLOOD_STEP, (before, checks)
