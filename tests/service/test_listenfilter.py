"""The listener's filter (service/overload/listenfilter.py) on real listeners of this process over 127.0.0.0/8 and
[::1]: a named peer's new connections never arrive (its SYNs are dropped, counted in the listener's drops), every
other peer's are accepted and carry data, connections accepted before or after it keep working, an IPv4 client of
a dual-stack listener is matched as IPv4, an IPv6 peer by its /64, and a descriptor that now holds another socket
is never touched."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest

from indexer_service.service.overload import listenfilter
from tests.service.sockets_support import ipv6_loopback, listener

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux")

# A dropped SYN is sent again after 1 s: a connect that has not completed in this long was dropped.
DROPPED_AFTER_SECONDS = 0.4


def inode(sock: socket.socket) -> int:
    return os.fstat(sock.fileno()).st_ino


def connects(server: socket.socket, source: str, host: str = "127.0.0.1") -> bool:
    """Whether a connection from ``source`` is accepted: it completes, and the server's end carries a byte."""
    client = socket.socket(socket.AF_INET6 if ":" in source else socket.AF_INET)
    with client:
        client.bind((source, 0))
        client.settimeout(DROPPED_AFTER_SECONDS)
        try:
            client.connect((host, server.getsockname()[1]))
        except TimeoutError:
            return False
        accepted, _ = server.accept()
        with accepted:
            return carries_data(client, accepted)


def carries_data(client: socket.socket, accepted: socket.socket) -> bool:
    client.sendall(b"ping")
    accepted.settimeout(1.0)
    client.settimeout(1.0)
    if accepted.recv(4) != b"ping":
        return False
    accepted.sendall(b"pong")
    return client.recv(4) == b"pong"


def test_a_named_peers_new_connections_are_dropped_before_accept_and_counted() -> None:
    with listener() as server:
        fd, ino = server.fileno(), inode(server)
        assert listenfilter.drops(fd, ino) == 0
        listenfilter.attach(fd, ino, listenfilter.program(["127.0.0.2", "127.0.0.3"]))
        assert not connects(server, "127.0.0.2")
        assert not connects(server, "127.0.0.3")
        assert connects(server, "127.0.0.1")
        assert connects(server, "127.0.0.4")
        assert listenfilter.drops(fd, ino) == 2  # one SYN each, within the first retransmission's wait
        listenfilter.attach(fd, ino, listenfilter.program(["127.0.0.3"]))  # replaced, not added to
        assert connects(server, "127.0.0.2")
        assert not connects(server, "127.0.0.3")
        listenfilter.detach(fd, ino)
        listenfilter.detach(fd, ino)  # none left: nothing to do
        assert connects(server, "127.0.0.3")
        assert listenfilter.drops(fd, ino) == 3


def test_connections_accepted_before_and_after_the_filter_keep_working() -> None:
    """Established connections are not the listener's: a dropped peer's earlier connection carries data both ways,
    and so does another peer's connection accepted while the filter is on (it inherits the filter, and only SYNs
    are compared)."""
    with listener() as server:
        earlier = socket.create_connection(server.getsockname(), source_address=("127.0.0.2", 0))
        earlier_accepted, _ = server.accept()
        listenfilter.attach(server.fileno(), inode(server), listenfilter.program(["127.0.0.2"]))
        later = socket.create_connection(server.getsockname(), source_address=("127.0.0.5", 0))
        later_accepted, _ = server.accept()
        with earlier, earlier_accepted, later, later_accepted:
            for _ in range(3):
                assert carries_data(earlier, earlier_accepted)
                assert carries_data(later, later_accepted)


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
def test_ipv6_peers_by_their_64_and_ipv4_clients_of_a_dual_stack_listener_as_ipv4() -> None:
    with listener("::", v6only=False) as server:
        fd, ino = server.fileno(), inode(server)
        listenfilter.attach(fd, ino, listenfilter.program(["::/64"]))  # ::1's /64
        assert not connects(server, "::1", "::1")
        assert connects(server, "127.0.0.2")  # an IPv4 packet, compared as IPv4
        listenfilter.attach(fd, ino, listenfilter.program(["127.0.0.2", "2001:db8::/64"]))
        assert not connects(server, "127.0.0.2")
        assert connects(server, "::1", "::1")


def test_the_most_peers_a_filter_names_fit_the_kernels_limits() -> None:
    peers = [f"127.0.1.{n}" for n in range(listenfilter.MAX_PEERS // 2)]
    peers += [f"2001:db8:0:{n:x}::/64" for n in range(listenfilter.MAX_PEERS // 2)]
    with listener() as server:
        listenfilter.attach(server.fileno(), inode(server), listenfilter.program(peers))
        assert not connects(server, "127.0.1.0")
        assert not connects(server, f"127.0.1.{listenfilter.MAX_PEERS // 2 - 1}")
        assert connects(server, f"127.0.1.{listenfilter.MAX_PEERS // 2}")


@pytest.mark.parametrize("peer", ["10.0.0.0/8", "2001:db8::/48", "2001:db8::1"])
def test_a_peer_is_an_ipv4_address_or_an_ipv6_64(peer: str) -> None:
    with pytest.raises(ValueError, match="IPv6 /64"):
        listenfilter.program([peer])


def test_a_descriptor_that_now_holds_another_socket_is_not_touched() -> None:
    with listener() as server:
        with pytest.raises(OSError) as raised:
            listenfilter.attach(server.fileno(), inode(server) + 1, listenfilter.program(["127.0.0.2"]))
        assert raised.value.errno == errno.ESTALE
        assert connects(server, "127.0.0.2")  # no filter was set
