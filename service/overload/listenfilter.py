"""New connections of some peers dropped by the kernel before accept: a classic BPF socket filter on a listener.

gRPC core accepts every connection its port has room for and offers no hook before it does, so a cap applied after
accept (:mod:`.peers`) lets a peer that reconnects as fast as it is cut keep its port full, and everyone else's new
connections are turned away meanwhile. The kernel runs a TCP socket's filter on every segment that reaches it, a
listener's included (``tcp_filter`` in ``tcp_v4_rcv`` / ``tcp_v6_rcv``, before the listener handles a SYN), and
drops the segment where the filter returns 0: a SYN from a peer that is at its cap never becomes a connection,
costs gRPC core nothing, and its sender retransmits it (after 1 s, then 3 s, 7 s, ...) until the peer has room again
or it gives up. The filter is set and replaced with ``SO_ATTACH_FILTER`` on a duplicate of the listener's
descriptor (the socket is the owner's: :mod:`.borrowed`), which needs
no privilege; ``SO_DETACH_FILTER`` removes it.

The program (``linux/filter.h``: each instruction {u16 code, u8 jt, u8 jf, u32 k}; jumps count instructions from
the next one; a plain load's offset is from the TCP header, ``SKF_NET_OFF`` + n from the IP header, and
``SKF_AD_OFF + SKF_AD_PROTOCOL`` is the packet's EtherType): a segment without SYN is kept at once (so the
connections the listener's children inherit the filter with pay three instructions a segment), then an IPv4
packet's source address is compared with each dropped IPv4 peer and an IPv6 packet's first 64 bits with each
dropped /64 (an IPv4 client of a dual-stack listener sends IPv4 packets). The kernel converts and JIT-compiles it;
each listener's child sockets share it and charge its size to their option memory (``net.core.optmem_max``, 20 KiB
or more), so at most :data:`MAX_PEERS` peers are named in one.

A listener's ``sk_drops`` (``SO_MEMINFO``) counts the segments its filter dropped and the connections its full
accept queue dropped (``tcp_listendrop``): both are connections turned away before the server saw them.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import socket
import struct
from collections.abc import Iterable

from indexer_service.service.overload.borrowed import borrowed

SO_ATTACH_FILTER, SO_DETACH_FILTER, SO_MEMINFO = 26, 27, 55
SK_MEMINFO_DROPS, SK_MEMINFO_VARS = 8, 9
_MEMINFO = struct.Struct(f"={SK_MEMINFO_VARS}I")
ETH_P_IP, ETH_P_IPV6 = 0x0800, 0x86DD
TCP_FLAGS_OFFSET, TCP_SYN = 13, 0x02
SKF_AD_OFF, SKF_AD_PROTOCOL, SKF_NET_OFF = -0x1000, 0, -0x100000
IPV4_SOURCE, IPV6_SOURCE = 12, 8  # offsets in the IP header
BPF_LD, BPF_JMP, BPF_RET = 0x00, 0x05, 0x06
BPF_W, BPF_H, BPF_B, BPF_ABS = 0x00, 0x08, 0x10, 0x20
BPF_JA, BPF_JEQ, BPF_JSET, BPF_K = 0x00, 0x10, 0x40, 0x00
KEEP, DROP = 0xFFFFFFFF, 0  # a filter returns how many bytes to keep
# Instructions: 12 at most around the peers, 2 per IPv4 peer, 5 per IPv6 /64: at most 332, under 3 KiB as
# converted, well within any optmem_max a kernel ships with.
MAX_PEERS = 64

_INSTRUCTION = struct.Struct("=HBBI")  # sock_filter


def _op(code: int, k: int = 0, jt: int = 0, jf: int = 0) -> bytes:
    return _INSTRUCTION.pack(code, jt, jf, k & 0xFFFFFFFF)


def program(peers: Iterable[str]) -> bytes:
    """The filter that drops SYNs from ``peers`` (as :func:`.peers.peer_of` writes them: an IPv4 address, an IPv6
    /64) and keeps everything else."""
    networks = {ipaddress.ip_network(peer) for peer in peers}
    v4 = sorted(network.network_address for network in networks if network.version == 4)
    v6 = sorted((network for network in networks if network.version == 6), key=str)
    if any(network.prefixlen != 64 for network in v6) or any(network.prefixlen != 32 for network in networks - set(v6)):
        raise ValueError("a peer is an IPv4 address or an IPv6 /64")
    v4_block = [_op(BPF_LD | BPF_W | BPF_ABS, SKF_NET_OFF + IPV4_SOURCE)]
    for address in v4:
        v4_block += [_op(BPF_JMP | BPF_JEQ | BPF_K, int(address), jf=1), _op(BPF_RET | BPF_K, DROP)]
    v4_block.append(_op(BPF_RET | BPF_K, KEEP))
    v6_block = []
    for network in v6:
        high, low = struct.unpack("!II", network.network_address.packed[:8])
        v6_block += [
            _op(BPF_LD | BPF_W | BPF_ABS, SKF_NET_OFF + IPV6_SOURCE),
            _op(BPF_JMP | BPF_JEQ | BPF_K, high, jf=3),  # another /64: the next peer's first instruction
            _op(BPF_LD | BPF_W | BPF_ABS, SKF_NET_OFF + IPV6_SOURCE + 4),
            _op(BPF_JMP | BPF_JEQ | BPF_K, low, jf=1),
            _op(BPF_RET | BPF_K, DROP),
        ]
    v6_block.append(_op(BPF_RET | BPF_K, KEEP))
    head = [
        _op(BPF_LD | BPF_B | BPF_ABS, TCP_FLAGS_OFFSET),
        _op(BPF_JMP | BPF_JSET | BPF_K, TCP_SYN, jt=1),
        _op(BPF_RET | BPF_K, KEEP),  # not a SYN
        _op(BPF_LD | BPF_H | BPF_ABS, SKF_AD_OFF + SKF_AD_PROTOCOL),
        _op(BPF_JMP | BPF_JEQ | BPF_K, ETH_P_IPV6, jf=1),
        _op(BPF_JMP | BPF_JA, 2 + len(v4_block)),  # to the IPv6 block, past the rest of the head and IPv4's
        _op(BPF_JMP | BPF_JEQ | BPF_K, ETH_P_IP, jt=1),
        _op(BPF_RET | BPF_K, KEEP),  # neither
    ]
    return b"".join(head + v4_block + v6_block)


def attach(fd: int, inode: int, filter_program: bytes) -> None:
    """Set (or replace) the filter of the listener on ``fd``; OSError where the kernel refuses it."""
    instructions = ctypes.create_string_buffer(filter_program, len(filter_program))
    fprog = struct.pack("@HP", len(filter_program) // _INSTRUCTION.size, ctypes.addressof(instructions))
    with borrowed(fd, inode) as listener:
        listener.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


def detach(fd: int, inode: int) -> None:
    """Remove the filter of the listener on ``fd``, if it has one."""
    with borrowed(fd, inode) as listener:
        try:
            listener.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # no filter
                raise


def drops(fd: int, inode: int) -> int:
    """The listener's ``sk_drops``: segments its filter dropped and connections its full accept queue dropped."""
    with borrowed(fd, inode) as listener:
        info = listener.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, _MEMINFO.size)
    return _MEMINFO.unpack(info.ljust(_MEMINFO.size, b"\0"))[SK_MEMINFO_DROPS]
