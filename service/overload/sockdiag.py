"""Established TCP connections of some local ports, asked of the kernel over netlink (NETLINK_SOCK_DIAG, inet_diag).

/proc/net/tcp and tcp6 list every TCP socket of the network namespace as text, TIME_WAIT ones included, and the
reader parses them all to keep a few; inet_diag walks the same tables in the kernel and sends back, as binary
records, only the sockets that pass the request's state mask and filter: here established ones (``TCPF_ESTABLISHED``)
whose local port is one asked for, an in-kernel bytecode filter. No dependency: pyroute2 has a sock_diag client,
but it is a large library for the one request made here, and decodes every record through its generic attribute
parser; psutil reads /proc. What is read is the stable kernel ABI of ``linux/netlink.h``, ``linux/sock_diag.h`` and
``linux/inet_diag.h`` (Linux 3.3 and later; the port comparisons used date from 2.6), all in the host's byte order
except ports and addresses, which are in network order:

- the request: ``nlmsghdr`` {u32 len, u16 type = SOCK_DIAG_BY_FAMILY (20), u16 flags = NLM_F_REQUEST | NLM_F_DUMP,
  u32 seq, u32 pid}, then ``inet_diag_req_v2`` {u8 family (AF_INET or AF_INET6: one request each, an IPv4 peer of a
  dual-stack listener being an AF_INET6 socket), u8 protocol = IPPROTO_TCP, u8 ext = 0, u8 pad, u32 states,
  ``inet_diag_sockid`` all zero (48 bytes)}, then one ``nlattr`` {u16 len, u16 type = INET_DIAG_REQ_BYTECODE (1)}
  holding the filter;
- the filter: ``inet_diag_bc_op`` {u8 code, u8 yes, u16 no}, each a comparison whose ``yes`` and ``no`` are how many
  bytes on the next op is; a port comparison (INET_DIAG_BC_S_GE 2, INET_DIAG_BC_S_LE 3) takes its port, in the
  host's order, from the ``no`` of the op after it. A socket is kept when the program runs exactly to its end, and
  dropped when a jump lands 4 bytes past it. Per port: ``sport >= p``, ``sport <= p``, then INET_DIAG_BC_JMP (1,
  always takes ``no``) to the end; a failed comparison goes on to the next port's, the last port's past the end;
- the answer: a multipart dump, read until NLMSG_DONE (3; its u32 is the dump's error, 0 or a negative errno) or
  NLMSG_ERROR (2; a negative errno, then the request's header), each record a ``nlmsghdr`` then ``inet_diag_msg``
  {u8 family, u8 state, u8 timer, u8 retrans, ``inet_diag_sockid`` {be16 sport, be16 dport, be32 src[4],
  be32 dst[4], u32 if, u32 cookie[2]}, u32 expires, u32 rqueue, u32 wqueue, u32 uid, u32 inode}, then attributes
  (none asked for, some always sent), the whole ``nlmsg_len`` long and 4-byte aligned. The kernel fills one buffer
  of at most 32 KiB per receive (``netlink_recvmsg`` caps it), so a larger one never truncates.

A socket still in the listener's accept queue is established but has no inode yet (0), as in /proc. A record that
moves between hash buckets while the dump is read may come twice or not at all, as a row of /proc may. Where
netlink or inet_diag is missing (seccomp, gVisor, no ``inet_diag``/``tcp_diag`` module), :func:`established`
raises OSError and the caller reads /proc instead (service/overload/peers.py). A receive that a signal interrupts
is retried by Python itself (PEP 475).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterable

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
TCPF_ESTABLISHED = 1 << 1  # 1 << TCP_ESTABLISHED
TCPF_LISTEN = 1 << 10  # 1 << TCP_LISTEN
INET_DIAG_REQ_BYTECODE = 1
INET_DIAG_BC_JMP, INET_DIAG_BC_S_GE, INET_DIAG_BC_S_LE = 1, 2, 3
RECEIVE_BYTES = 64 * 1024  # twice what the kernel puts in one receive of a dump

_HEADER = struct.Struct("=IHHII")  # nlmsghdr
_REQUEST = struct.Struct("=BBBxI48x")  # inet_diag_req_v2, its inet_diag_sockid all zero
_ATTRIBUTE = struct.Struct("=HH")  # nlattr
_OP = struct.Struct("=BBH")  # inet_diag_bc_op
_ERRNO = struct.Struct("=i")  # NLMSG_ERROR's and NLMSG_DONE's payload
# nlmsghdr's len and type, then inet_diag_msg's local port (network order), remote address and inode
_RECORDS = {
    socket.AF_INET: struct.Struct("=IH10x4xH2x16x4s12x12x16xI"),
    socket.AF_INET6: struct.Struct("=IH10x4xH2x16x16s12x16xI"),
}
_RECORD_BYTES = 88
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_PORT_OPS = 5  # per port: S_GE and its port, S_LE and its port, JMP


def port_filter(ports: Iterable[int]) -> bytes:
    """The inet_diag bytecode that keeps a socket whose local port is one of ``ports`` (the module docstring)."""
    wanted = sorted(set(ports))
    size = len(wanted) * _PORT_OPS * _OP.size
    program = bytearray()
    for index, port in enumerate(wanted):
        here = len(program)
        # where a failed comparison goes, counted from that comparison: the next port's first op, or past the end
        next_port = here + _PORT_OPS * _OP.size if index + 1 < len(wanted) else size + _OP.size
        program += _OP.pack(INET_DIAG_BC_S_GE, 2 * _OP.size, next_port - here)
        program += _OP.pack(0, 0, port)
        program += _OP.pack(INET_DIAG_BC_S_LE, 2 * _OP.size, next_port - here - 2 * _OP.size)
        program += _OP.pack(0, 0, port)
        program += _OP.pack(INET_DIAG_BC_JMP, _OP.size, size - len(program))
    return bytes(program)


def dump_request(family: int, program: bytes, seq: int = 1, states: int = TCPF_ESTABLISHED) -> bytes:
    """A SOCK_DIAG_BY_FAMILY dump of ``family``'s TCP sockets in ``states`` that pass ``program``."""
    attribute = _ATTRIBUTE.pack(_ATTRIBUTE.size + len(program), INET_DIAG_REQ_BYTECODE) + program
    body = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, states) + attribute
    return _HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


def address_of(raw: bytes) -> Address:
    """An address as inet_diag sends it (4 or 16 bytes); an IPv4 peer of a dual-stack listener as IPv4."""
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def established(ports: Iterable[int]) -> list[tuple[int, int, Address]]:
    """``(local port, inode, peer address)`` of each established TCP connection to one of ``ports`` in this network
    namespace, any process's, as :func:`indexer_service.service.overload.peers.established` reads them from /proc.
    OSError where the kernel does not answer sock_diag requests."""
    return _dump(ports, TCPF_ESTABLISHED)


def listening(ports: Iterable[int]) -> list[tuple[int, int]]:
    """``(local port, inode)`` of each listening TCP socket on one of ``ports`` in this network namespace, any
    process's (a port that workers share with SO_REUSEPORT has one each). OSError as :func:`established`."""
    return [(port, inode) for port, inode, _ in _dump(ports, TCPF_LISTEN)]


def _dump(ports: Iterable[int], states: int) -> list[tuple[int, int, Address]]:
    by_wire = {socket.htons(port): port for port in ports}  # a record's port as it unpacks: network order
    rows: list[tuple[int, int, Address]] = []
    if not by_wire:
        return rows
    program = port_filter(by_wire.values())
    addresses: dict[bytes, Address] = {}  # each peer decoded once
    # The buffer has a record's worth past what a receive fills: the loop unpacks a whole record before it knows
    # whether the message is one, and never past the buffer's end.
    buffer = bytearray(RECEIVE_BYTES + _RECORD_BYTES)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as netlink:
        for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), 1):
            netlink.sendto(dump_request(family, program, seq, states), (0, 0))
            record = _RECORDS[family]
            done = False
            while not done:
                size = netlink.recv_into(buffer, RECEIVE_BYTES, socket.MSG_TRUNC)
                if size > RECEIVE_BYTES:  # MSG_TRUNC: the message's own size, larger than the buffer
                    raise OSError(f"sock_diag message of {size} bytes truncated to {RECEIVE_BYTES}")
                offset = 0
                while offset < size:
                    length, kind, port, raw, inode = record.unpack_from(buffer, offset)
                    if kind == SOCK_DIAG_BY_FAMILY:
                        address = addresses.get(raw)
                        if address is None:
                            address = addresses[raw] = address_of(raw)
                        rows.append((by_wire[port], inode, address))
                    elif kind in (NLMSG_DONE, NLMSG_ERROR):
                        (error,) = _ERRNO.unpack_from(buffer, offset + _HEADER.size)
                        if error < 0:
                            raise OSError(-error, f"sock_diag: {os.strerror(-error)}")
                        done = True
                        break
                    if length < _HEADER.size:
                        raise OSError(f"sock_diag message of {length} bytes")
                    offset += (length + 3) & ~3
    return rows
