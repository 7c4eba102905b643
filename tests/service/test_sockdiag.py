"""The established connections of some ports read over netlink sock_diag (service/overload/sockdiag.py): on real
sockets of this process over 127.0.0.1 and [::1], exactly the accepted connections of the ports asked (peer and
inode), none of another port, of a listener or of a connection closing, and the same rows as /proc gives; then, on
a stand-in netlink socket, a dump split over several receives, and the kernel's errors raised as OSError."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest

from indexer_service.service.overload import peers, sockdiag
from tests.service.sockets_support import ipv6_loopback, listener

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux")


def netlink_answers() -> bool:
    try:
        sockdiag.established([1])
    except OSError:
        return False
    return True


needs_sock_diag = pytest.mark.skipif(not netlink_answers(), reason="the kernel does not answer sock_diag here")


def connect(stack: ExitStack, server: socket.socket, source: str, to: str | None = None) -> socket.socket:
    """A connection from ``source`` (to ``to``, else the listener's own address): the accepted end."""
    client = stack.enter_context(socket.socket(socket.AF_INET6 if ":" in source else socket.AF_INET))
    client.bind((source, 0))
    client.connect((to or server.getsockname()[0], server.getsockname()[1]))
    return stack.enter_context(server.accept()[0])


def row(accepted: socket.socket) -> tuple[int, int, ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """What a reader should give for a connection this process accepted."""
    peer = ipaddress.ip_address(accepted.getpeername()[0])
    if isinstance(peer, ipaddress.IPv6Address) and peer.ipv4_mapped is not None:
        peer = peer.ipv4_mapped
    return accepted.getsockname()[1], os.fstat(accepted.fileno()).st_ino, peer


@needs_sock_diag
def test_exactly_the_established_connections_of_the_ports_asked() -> None:
    with (
        listener() as first,
        listener() as second,
        listener() as other,
        listener("127.0.0.1") as closing,
        ExitStack() as stack,
    ):
        wanted = [connect(stack, first, "127.0.0.2") for _ in range(20)]
        wanted += [connect(stack, second, f"127.0.0.{3 + index}") for index in range(3)]
        for _ in range(3):  # a port not asked for
            connect(stack, other, "127.0.0.2")
        # On a port asked for, connections that are no longer established: one the server shut down (FIN_WAIT,
        # then TIME_WAIT) and one its peer closed (CLOSE_WAIT).
        shut = connect(stack, closing, "127.0.0.2")
        shut.shutdown(socket.SHUT_RDWR)
        peer_closed = stack.enter_context(socket.socket())
        peer_closed.connect(closing.getsockname())
        accepted = stack.enter_context(closing.accept()[0])
        peer_closed.close()
        ports = [first.getsockname()[1], second.getsockname()[1], closing.getsockname()[1]]
        rows = sockdiag.established(ports)
        assert sorted(rows) == sorted(row(sock) for sock in wanted)
        assert sorted(rows) == sorted(peers.established(ports))
        assert os.fstat(accepted.fileno()).st_ino not in {inode for _, inode, _ in rows}


@needs_sock_diag
@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
def test_ipv6_connections_and_ipv4_peers_of_a_dual_stack_listener() -> None:
    with listener("::1") as v6, listener("::", v6only=False) as dual, ExitStack() as stack:
        wanted = [connect(stack, v6, "::1") for _ in range(4)]
        wanted += [connect(stack, dual, "127.0.0.2", to="127.0.0.1") for _ in range(2)]
        wanted += [connect(stack, dual, "::1", to="::1")]
        ports = [v6.getsockname()[1], dual.getsockname()[1]]
        rows = sockdiag.established(ports)
        assert sorted(rows, key=str) == sorted((row(sock) for sock in wanted), key=str)
        assert ipaddress.ip_address("127.0.0.2") in {address for _, _, address in rows}  # not ::ffff:127.0.0.2
        assert sorted(rows, key=str) == sorted(peers.established(ports), key=str)


@needs_sock_diag
def test_listeners_of_the_ports_asked_and_none_of_their_connections() -> None:
    with listener() as first, listener() as second, listener() as other, ExitStack() as stack:
        connect(stack, first, "127.0.0.2")
        ports = [first.getsockname()[1], second.getsockname()[1]]
        rows = sockdiag.listening(ports)
        assert sorted(rows) == sorted(
            (sock.getsockname()[1], os.fstat(sock.fileno()).st_ino) for sock in (first, second)
        )
        assert sorted(rows) == sorted(peers.listening(ports))
        assert other.getsockname()[1] not in {port for port, _ in rows}


@needs_sock_diag
def test_nothing_asked_nothing_read() -> None:
    with listener() as server, ExitStack() as stack:
        connect(stack, server, "127.0.0.2")
        assert sockdiag.established([]) == []


# A stand-in for the kernel: what each receive of each dump returns.

_INET_DIAG_MSG = struct.Struct("=BBBBHH16s16sI8sIIIII")


def message(kind: int, payload: bytes, seq: int = 1) -> bytes:
    length = 16 + len(payload)
    return struct.pack("=IHHII", length, kind, 2, seq, 0) + payload + bytes(-length % 4)


def record(port: int, peer: str, inode: int, attributes: int = 8) -> bytes:
    """A SOCK_DIAG_BY_FAMILY record of an established connection, with ``attributes`` bytes after the struct, as
    the kernel sends (INET_DIAG_SHUTDOWN and others, always there)."""
    address = ipaddress.ip_address(peer)
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    body = _INET_DIAG_MSG.pack(
        family, 1, 0, 0, socket.htons(port), socket.htons(40000), bytes(16), address.packed.ljust(16, b"\0"),
        0, bytes(8), 0, 0, 0, 0, inode,
    )  # fmt: skip
    return message(sockdiag.SOCK_DIAG_BY_FAMILY, body + bytes(attributes))


def done(error: int = 0) -> bytes:
    return message(sockdiag.NLMSG_DONE, struct.pack("=i", error))


class Kernel:
    """A netlink socket whose receives return ``answers`` in turn (a list per dump request, AF_INET then
    AF_INET6); ``sizes`` overrides the size a receive reports (a truncated message)."""

    def __init__(self, *answers: list[bytes], sizes: dict[int, int] | None = None) -> None:
        self.answers = [list(dump) for dump in answers]
        self.sizes = sizes or {}
        self.requests: list[bytes] = []
        self.receives = 0

    def __call__(self, family: int, kind: int, protocol: int) -> Kernel:
        assert (family, kind, protocol) == (socket.AF_NETLINK, socket.SOCK_RAW, sockdiag.NETLINK_SOCK_DIAG)
        return self

    def __enter__(self) -> Kernel:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def sendto(self, request: bytes, address: tuple[int, int]) -> int:
        self.requests.append(request)
        return len(request)

    def recv_into(self, buffer: bytearray, size: int, flags: int) -> int:
        assert flags == socket.MSG_TRUNC
        answer = self.answers[len(self.requests) - 1].pop(0)
        buffer[: len(answer)] = answer
        self.receives += 1
        return self.sizes.get(self.receives, len(answer))


@pytest.fixture
def kernel(monkeypatch):
    def install(*answers: list[bytes], sizes: dict[int, int] | None = None) -> Kernel:
        stand_in = Kernel(*answers, sizes=sizes)
        monkeypatch.setattr(sockdiag, "socket", SimpleNamespace(**{**vars(socket), "socket": stand_in}))
        return stand_in

    return install


def test_a_dump_is_read_over_several_receives_until_done(kernel) -> None:
    stand_in = kernel(
        [record(50051, "10.0.0.1", 11) + record(50051, "10.0.0.2", 12), record(8080, "10.0.0.1", 13) + done()],
        [record(50051, "2001:db8::1", 14, attributes=20), record(50051, "::ffff:10.0.0.3", 15) + done()],
    )
    assert sockdiag.established([50051, 8080]) == [
        (50051, 11, ipaddress.ip_address("10.0.0.1")),
        (50051, 12, ipaddress.ip_address("10.0.0.2")),
        (8080, 13, ipaddress.ip_address("10.0.0.1")),
        (50051, 14, ipaddress.ip_address("2001:db8::1")),
        (50051, 15, ipaddress.ip_address("10.0.0.3")),
    ]
    assert stand_in.receives == 4
    families = [request[16] for request in stand_in.requests]  # inet_diag_req_v2's first byte
    assert families == [socket.AF_INET, socket.AF_INET6]


@pytest.mark.parametrize(
    "answer",
    [
        message(sockdiag.NLMSG_ERROR, struct.pack("=i", -errno.ENOENT) + bytes(16)),  # no tcp_diag module
        record(50051, "10.0.0.1", 11) + done(-errno.ENOENT),  # the dump itself failed
    ],
)
def test_the_kernels_errors_are_raised(kernel, answer: bytes) -> None:
    kernel([answer])
    with pytest.raises(OSError) as raised:
        sockdiag.established([50051])
    assert raised.value.errno == errno.ENOENT


def test_a_truncated_receive_is_an_error(kernel) -> None:
    kernel([record(50051, "10.0.0.1", 11) + done()], sizes={1: sockdiag.RECEIVE_BYTES + 1})
    with pytest.raises(OSError, match="truncated"):
        sockdiag.established([50051])


def test_the_filter_keeps_each_port_asked_and_no_other() -> None:
    """The bytecode as the kernel runs it (inet_diag_bc_run): each op's yes or no is how far the next one is;
    accepted when it ends exactly at the end, dropped past it."""
    program = sockdiag.port_filter([8080, 50051, 9000])

    def accepted(port: int) -> bool:
        offset = 0
        while offset < len(program):
            code, yes, no = struct.unpack_from("=BBH", program, offset)
            value = struct.unpack_from("=BBH", program, offset + 4)[2] if code != sockdiag.INET_DIAG_BC_JMP else 0
            passed = {
                sockdiag.INET_DIAG_BC_S_GE: port >= value,
                sockdiag.INET_DIAG_BC_S_LE: port <= value,
                sockdiag.INET_DIAG_BC_JMP: False,
            }[code]
            offset += yes if passed else no
        return offset == len(program)

    assert [port for port in range(7000, 51000) if accepted(port)] == [8080, 9000, 50051]
