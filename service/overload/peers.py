"""Connections per peer: a cap that gRPC core cannot apply, applied just after accept.

gRPC core caps a port's connections (``grpc.max_allowed_incoming_connections``) but knows nothing of who opened
them, and grpcio offers no hook at accept; so one peer that opens connections and holds them could fill a port and
turn every other client (and the probes) away. The kernel knows each connection's peer: every fifth of a second
(every twentieth while it is cutting a flood, less often while the reading costs more), while the process holds
more descriptors than ``max_connections_per_peer``, :class:`PeerCap` asks the kernel for the established TCP
connections of its ports (netlink sock_diag, :mod:`.sockdiag`; where the kernel refuses it, /proc/net/tcp and tcp6,
said once in a WARNING), and where a peer (an IPv4 address, or an IPv6 /64) is past the cap on a port, finds its
own sockets (/proc/self/fd) and shuts that peer's connections down, those that came since the last check first.
``shutdown(2)`` on a duplicate of the descriptor: the owner (gRPC core, uvicorn) sees the connection end and closes
its own descriptor; nothing is closed under it, and a descriptor reused meanwhile by another connection is told
apart by its inode. Each process caps its own connections (with workers, each worker's share of the shared port, as
``grpc_max_connections``). Counted in ``indexer_peer_connections_closed_total{port}`` and logged, rate-limited.

A peer that reconnects as fast as it is cut still takes the room each cut frees, at its own connection rate;
the port's own cap still bounds the total (docs/overload.md, "Connections").
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import stat
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from indexer_service.service.observability.logs import RateLimitedLog
from indexer_service.service.overload import sockdiag
from indexer_service.service.overload.allocator import open_fds
from indexer_service.service.overload.sockdiag import Address
from indexer_service.service.reasons import Port

if TYPE_CHECKING:  # the supervisor imports this module before it names the multiprocess directory
    from prometheus_client import Counter

log = logging.getLogger(__name__)

TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_ESTABLISHED = "01"  # st in /proc/net/tcp: TCP_ESTABLISHED
LOG_INTERVAL_SECONDS = 10.0
# How often the cap is checked: every fifth of a second, and every twentieth while the last check cut connections.
# A peer that connects as fast as gRPC core accepts fills the port's free room within a few tenths of a second,
# from its first connection and again after each cut, and other peers' connections are refused meanwhile
# (docs/performance.md). While the process holds no more descriptors than the cap a check costs one listing of them.
CHECK_SECONDS, CUTTING_CHECK_SECONDS = 0.2, 0.05
# A check's reading takes at most this share of the time between checks (of a CPU and of the GIL): what it reads
# grows with the connections of its ports, and on the /proc fallback with every socket of the network namespace,
# TIME_WAIT ones included (a long reconnecting flood leaves up to net.ipv4.tcp_max_tw_buckets of them:
# docs/performance.md), so a costly reading waits longer for the next. The shutdowns are not counted: at most the
# connections a flood opened since the last check, which the port's own cap bounds.
CHECK_SHARE = 0.1
MAX_CHECK_SECONDS = 5.0  # however costly the check, the cap is applied at least this often
_clock = time.thread_time  # a check's cost: its thread's CPU time (a test's fake clock)


def socket_inodes(fd_dir: str = "/proc/self/fd") -> dict[int, int]:
    """This process's sockets: inode -> descriptor (none where /proc is missing). Each descriptor's ``fstat``, not
    the link /proc shows for it: the same inode, without the path lookup and the name the kernel writes
    (docs/performance.md)."""
    found: dict[int, int] = {}
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return found
    for name in names:
        fd = int(name)
        try:
            status = os.fstat(fd)
        except OSError:  # closed meanwhile
            continue
        if stat.S_ISSOCK(status.st_mode):
            found[status.st_ino] = fd
    return found


def proc_address(hex_address: str) -> Address:
    """An address as /proc/net/tcp{,6} writes it (each 32-bit word in the host's byte order, in hex); an IPv4 peer
    of a dual-stack listener (``::ffff:a.b.c.d``) as IPv4."""
    raw = bytes.fromhex(hex_address)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return sockdiag.address_of(raw)


def peer_of(address: Address) -> str:
    """Whom a connection from ``address`` counts against, as text: an IPv4 address, or an IPv6 address's /64 (a
    host picks any address of its /64 at will, so a cap per IPv6 address would cap nothing)."""
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def established(ports: Iterable[int], tables: Iterable[str] = TCP_TABLES) -> list[tuple[int, int, Address]]:
    """``(local port, inode, peer address)`` of each established TCP connection to one of ``ports`` in this network
    namespace, any process's, read from /proc (where :func:`sockdiag.established` cannot ask the kernel)."""
    wanted = set(ports)
    rows = []
    addresses: dict[str, Address] = {}  # each peer decoded once
    for table in tables:
        try:
            lines = open(table)  # noqa: SIM115 - closed below; a missing table (no IPv6) is skipped
        except OSError:
            continue
        with lines:
            next(lines, None)  # the header
            for line in lines:
                # sl, local, remote, st, then the rest (split only for the rows kept: after a flood is cut, its
                # connections linger by the thousand in TIME_WAIT)
                fields = line.split(None, 4)
                if len(fields) < 5 or fields[3] != _ESTABLISHED:
                    continue
                local, remote = fields[1], fields[2]
                port = int(local[local.rindex(":") + 1 :], 16)
                if port in wanted:
                    inode = int(fields[4].split()[5])  # tx:rx, tr:when, retrnsmt, uid, timeout, inode
                    remote = remote[: remote.rindex(":")]
                    address = addresses.get(remote)
                    if address is None:
                        address = addresses[remote] = proc_address(remote)
                    rows.append((port, inode, address))
    return rows


def shut_down(fd: int, inode: int) -> bool:
    """Shut the connection on ``fd`` down both ways if ``fd`` is still the socket ``inode``; its owner closes it."""
    try:
        duplicate = os.dup(fd)
    except OSError:  # closed meanwhile
        return False
    try:
        if os.fstat(duplicate).st_ino != inode:  # the descriptor now holds another connection
            return False
        connection = socket.socket(fileno=duplicate)
    except OSError:
        os.close(duplicate)
        return False
    try:
        connection.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:  # already gone
        return False
    finally:
        connection.close()  # the duplicate only


class PeerCap:
    """At most ``cap`` established connections per peer on each of ``ports`` (local port -> its name) among this
    process's own; ``cap`` 0: no cap. :meth:`check` is one reading; ``closed_total`` (a counter by ``port``)
    counts what it shut down."""

    def __init__(
        self,
        cap: int,
        ports: Mapping[int, Port],
        closed_total: Counter,
        read: Callable[[Iterable[int]], list[tuple[int, int, Address]]] | None = None,
    ) -> None:
        self.cap = cap
        self._read = read  # None: sockdiag's, until the kernel refuses it, then /proc's (established)
        self.ports: dict[int, Port] = {}
        for port, name in ports.items():
            self.add_port(port, name)
        self.closed_total = closed_total
        self._seen: set[int] = set()  # the inodes of the last check's connections
        self._cutting_seconds = 0.0  # what the last check's shutdowns cost (_clock)
        self._log = RateLimitedLog(log, LOG_INTERVAL_SECONDS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-cap", daemon=True)

    def start(self) -> None:
        """Check on a daemon thread until :meth:`stop` (nothing to do without a cap)."""
        if self.cap > 0:
            self._established()  # the reader picked now: its fallback, if any, said at start
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        interval = CHECK_SECONDS
        while not self._stop.wait(interval):
            started = _clock()
            try:
                closed = self.check(open_fds())
            except Exception as exc:  # a /proc format it does not know: say so (rate-limited), keep serving
                self._log.write(
                    "failed",
                    lambda count, exc=exc: log.error("connection cap check failed count=%d", count, exc_info=exc),
                )
                closed = 0
            spent = _clock() - started - self._cutting_seconds
            interval = min(
                MAX_CHECK_SECONDS, max(CUTTING_CHECK_SECONDS if closed else CHECK_SECONDS, spent / CHECK_SHARE)
            )

    def add_port(self, port: int, name: Port) -> None:
        """A port bound after start (a worker joins the gRPC port once warmed up)."""
        if self.ports.get(port, name) != name:  # two listeners on other addresses, the same number
            log.warning(
                "ports %s and %s share the number %d: their connections count together", self.ports[port], name, port
            )
        self.ports = {**self.ports, port: name}

    def _established(self) -> list[tuple[int, int, Address]]:
        """The established connections of this process's ports, through netlink where the kernel answers."""
        if self._read is None:
            try:
                return sockdiag.established(self.ports)
            except OSError as exc:
                log.warning(
                    "connection cap reads /proc/net/tcp and tcp6: netlink sock_diag unavailable (%s); each check "
                    'costs more as the network namespace\'s TCP tables grow (docs/overload.md, "Connections")',
                    exc,
                )
                self._read = established
        return self._read(self.ports)

    def check(self, fds: int) -> int:
        """With ``fds`` open descriptors: shut down each peer's connections past the cap; how many. A peer's
        connections that were there at the last check are kept before those that came since (then by inode,
        roughly in the order they came: the kernel hands inodes out in blocks per CPU)."""
        self._cutting_seconds = 0.0
        if self.cap <= 0 or fds <= self.cap or not self.ports:
            self._seen = set()
            return 0  # no peer can hold more connections than the process has descriptors
        peers: dict[Address, str] = {}  # each remote address, read once per check
        # a set: a busy table may list a connection twice
        by_peer: dict[tuple[int, str], set[int]] = defaultdict(set)
        for port, inode, remote in self._established():
            peer = peers.get(remote)
            if peer is None:
                peer = peers[remote] = peer_of(remote)
            by_peer[port, peer].add(inode)
        seen, self._seen = self._seen, set().union(*by_peer.values())
        over = {key: inodes for key, inodes in by_peer.items() if len(inodes) > self.cap}
        if not over:
            return 0
        mine = socket_inodes()
        cut: dict[int, list[tuple[int, str, int]]] = defaultdict(list)  # port -> (held, peer, closed)
        cutting = _clock()
        for (port, peer), inodes in over.items():
            own = sorted((inode for inode in inodes if inode in mine), key=lambda inode: (inode not in seen, inode))
            closed = sum(shut_down(mine[inode], inode) for inode in own[self.cap :])
            if closed:
                cut[port].append((len(own), peer, closed))
        self._cutting_seconds = _clock() - cutting
        total = 0
        for port, peers_cut in cut.items():
            name, closed = self.ports[port], sum(closed for _, _, closed in peers_cut)
            total += closed
            self.closed_total.labels(port=name).inc(closed)
            held, worst, _ = max(peers_cut)
            peers = len(peers_cut)
            self._log.write(  # per port, not per peer: many peers make one line, not many
                name,
                lambda count, name=name, peers=peers, worst=worst, held=held, closed=closed: log.warning(
                    "peers over their connection cap port=%s peers=%d worst_peer=%s held=%d "
                    "max_connections_per_peer=%d closed=%d count=%d",
                    name,
                    peers,
                    worst,
                    held,
                    self.cap,
                    closed,
                    count,
                ),
            )
        return total
