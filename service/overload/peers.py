"""Connections per peer: a cap that gRPC core cannot apply, applied just after accept and then before it.

gRPC core caps a port's connections (``grpc.max_allowed_incoming_connections``) but knows nothing of who opened
them, and grpcio offers no hook at accept; so one peer that opens connections and holds them could fill a port and
turn every other client (and the probes) away. The kernel knows each connection's peer: every fifth of a second
(every twentieth while it is cutting a flood, at once when the process's descriptors jump, less often while the
reading costs more), while the process holds more descriptors than ``max_connections_per_peer``, :class:`PeerCap`
asks the kernel for the established TCP connections of its ports (netlink sock_diag, :mod:`.sockdiag`; where the
kernel refuses it, /proc/net/tcp and tcp6, said once in a WARNING), and where a peer (an IPv4 address, or an IPv6
/64) is past the cap on a port, finds its own sockets (/proc/self/fd) and shuts that peer's connections down, those
that came since the last check first. ``shutdown(2)`` on a duplicate of the descriptor: the owner (gRPC core,
uvicorn) sees the connection end and closes its own descriptor; nothing is closed under it, and a descriptor reused
meanwhile by another connection is told apart by its inode. While a peer holds the cap, the listeners of that port
that this process alone holds drop its new connections before accept (:mod:`.listenfilter`): a peer that reconnects
as fast as it is cut gets nothing more, and costs gRPC core nothing. Each process caps its own connections (with
workers, each worker's share of the shared port, as ``grpc_max_connections``). Counted in
``indexer_peer_connections_closed_total{port}``, ``indexer_peers_at_connection_cap{port}`` and
``indexer_connections_dropped_before_accept_total{port}``, and logged, rate-limited.

Many peers each under the cap can still fill a port together: once a port's connections reach CROWDED of its own cap,
each peer is held to a share of it the same way, so that room stays for the peers that hold none. What it does not
stop: a flood's first burst, which reaches the port before the first check that sees it; the port's own cap bounds
that (docs/overload.md, "Connections"). Where a transport sees each connection arrive (the HTTP ports' protocol),
:class:`PortShares` applies the same rule at accept, and no burst passes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import ipaddress
import logging
import os
import select
import socket
import stat
import struct
import sys
import termios
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Generic, TypeVar

from indexer_service.service.observability.logs import RateLimitedLog
from indexer_service.service.overload import listenfilter, sockdiag
from indexer_service.service.overload.allocator import open_fds
from indexer_service.service.overload.borrowed import borrowed
from indexer_service.service.overload.sockdiag import Address
from indexer_service.service.reasons import Port

if TYPE_CHECKING:  # the supervisor imports this module before it names the multiprocess directory
    from indexer_service.service.config import ServiceConfig
    from indexer_service.service.observability.metrics import PeerCapMetrics

log = logging.getLogger(__name__)

TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
Held = TypeVar("Held")  # a transport's handle on one connection (PortShares)
_INT = struct.Struct("i")  # an ioctl's int argument
_ESTABLISHED, _LISTEN = "01", "0A"  # st in /proc/net/tcp: TCP_ESTABLISHED, TCP_LISTEN
LOG_INTERVAL_SECONDS = 10.0
# How often the cap is checked: every fifth of a second, every twentieth while the last check cut connections, and
# at once when the process's descriptors grew by FLOOD_STEP since the last check, while the checks' cost stays within
# CHECK_SHARE: a connection reaching one of the process's own listeners wakes the checking thread, which reads the
# descriptor count POLL_SECONDS later (the rest of a burst lands meanwhile), so at most that often while connections
# keep coming, and never in between while none come. A peer that connects as fast as gRPC core accepts fills a
# port's free room within a few tenths of a second, and other peers' connections are refused meanwhile
# (docs/overload.md); once a check has seen it at its cap, the kernel drops its new connections before accept. While
# the process holds no more descriptors than the cap a check costs one reading of the listeners' drop counts.
CHECK_SECONDS, CUTTING_CHECK_SECONDS, POLL_SECONDS = 0.2, 0.05, 0.01
FLOOD_STEP = 64
# A check's reading takes at most this share of the time between checks (of a CPU and of the GIL): what it reads
# grows with the connections of its ports, and on the /proc fallback with every socket of the network namespace,
# TIME_WAIT ones included (a long reconnecting flood leaves up to net.ipv4.tcp_max_tw_buckets of them:
# docs/performance.md), so a costly reading waits longer for the next. The shutdowns are not counted: at most the
# connections a flood opened since the last check, which the port's own cap bounds.
CHECK_SHARE = 0.1
# While the last check cut connections, a flood is filling a port and others' connections are being refused: the
# next check may take up to half its thread's time, so that the cut keeps up.
CUTTING_CHECK_SHARE = 0.5
MAX_CHECK_SECONDS = 5.0  # however costly the check, the cap is applied at least this often
# A port whose own connections reach CROWDED of its cap (grpc_max_connections and so on) is crowded until they fall
# under UNCROWDED: meanwhile each peer may hold only its share of CROWDED_SHARE of the cap (over the peers holding
# its connections, at least 1), those past it shut down and its new ones dropped before accept, so that a fifth of
# the port stays free for the peers that hold none, the kubelet's probes among them, however many peers fill it.
CROWDED, UNCROWDED, CROWDED_SHARE = 0.9, 0.7, 0.8
_clock = time.thread_time  # a check's cost: its thread's CPU time (a test's fake clock)


def crowd_floor(limit: int, crowded: bool) -> float:
    """How many connections make a port with ``limit`` (its own cap) crowded: CROWDED of it, UNCROWDED while it
    already is; never where it has no cap (0)."""
    return limit * (UNCROWDED if crowded else CROWDED) if limit > 0 else float("inf")


def crowded_share(limit: int, cap: int, peers: int) -> int:
    """Each peer's share of a crowded port with ``limit`` among ``peers`` peers: CROWDED_SHARE of the limit over
    them, at least 1 and at most ``cap``."""
    return min(cap, max(1, int(limit * CROWDED_SHARE) // max(1, peers)))


class PortShares(Generic[Held]):
    """One port's connections in this process, by peer, as a transport that sees each one arrive counts them (the
    HTTP ports' protocol): the rule :class:`PeerCap` applies after accept, applied at accept instead. A connection
    that would take its peer past its share is refused; on a crowded port, one within its peer's share displaces the
    latest connection of the peer most past its own share (shares shrink as peers arrive), so however fast they come
    the port stays at CROWDED of its cap and a newcomer (the kubelet's probe) finds room, as long as its connections
    there outnumber its peers.
    ``cap``: ``max_connections_per_peer`` (0: no cap); ``limit``: the port's own cap. Each connection is a handle
    of the transport's, given back by :meth:`admit` when it is to be closed."""

    def __init__(self, cap: int, limit: int) -> None:
        self.cap, self.limit = cap, limit
        self.held: dict[str, dict[Held, None]] = {}  # peer -> its open connections, in the order they came
        self._peer_of: dict[Held, str] = {}  # each counted connection's peer
        self.crowded = False

    def admit(self, peer: str | None, connection: Held, open_connections: int) -> tuple[bool, Held | None]:
        """Whether ``connection`` of ``peer`` (None: not an IP peer, not capped) may open while the port has
        ``open_connections``; if so it is counted until :meth:`release`. With it, the connection to close to make
        room (already released), or None."""
        if peer is None or self.cap <= 0:
            return True, None
        self.crowded = open_connections >= crowd_floor(self.limit, self.crowded)
        mine = self.held.get(peer)
        held = len(mine) if mine else 0
        share = crowded_share(self.limit, self.cap, len(self.held) + (not held)) if self.crowded else self.cap
        if held >= share:
            return False, None
        self.held.setdefault(peer, {})[connection] = None
        self._peer_of[connection] = peer
        if not self.crowded or open_connections < crowd_floor(self.limit, crowded=False):
            return True, None
        most = max(self.held, key=lambda other: len(self.held[other]))
        if len(self.held[most]) <= share:
            return True, None
        displaced = next(reversed(self.held[most]))
        self.release(displaced)
        return True, displaced

    def release(self, connection: Held) -> None:
        """``connection`` has closed (or is closing); nothing where it was never counted or is released already."""
        peer = self._peer_of.pop(connection, None)
        if peer is None:
            return
        mine = self.held[peer]
        del mine[connection]
        if not mine:
            del self.held[peer]


class CheckSchedule:
    """When the next check is due, from what the last one cost and found (times from ``time.monotonic()``): after
    CHECK_SECONDS, or CUTTING_CHECK_SECONDS if it cut connections; sooner once descriptors jump, as soon as the last
    one's cost allows (CHECK_SHARE of the time between, CUTTING_CHECK_SHARE after one that cut)."""

    def __init__(self) -> None:
        self.due = self.earliest = 0.0  # the next check at ``due``, or from ``earliest`` on if descriptors jump
        self.fds = 0  # the descriptors at the last check

    def is_due(self, now: float, fds: int) -> bool:
        return now >= self.due or (now >= self.earliest and fds >= self.fds + FLOOD_STEP)

    def checked(self, now: float, fds: int, spent: float, closed: int) -> None:
        """A check began at ``now`` with ``fds`` descriptors, read for ``spent`` seconds of its thread's CPU time
        (its shutdowns not counted) and shut ``closed`` connections down."""
        floor = spent / (CUTTING_CHECK_SHARE if closed else CHECK_SHARE)
        self.earliest = now + min(MAX_CHECK_SECONDS, floor)
        self.due = now + min(MAX_CHECK_SECONDS, max(CUTTING_CHECK_SECONDS if closed else CHECK_SECONDS, floor))
        self.fds = fds


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


@functools.lru_cache(maxsize=8192)
def peer_of_host(host: str) -> str | None:
    """:func:`peer_of` a host as a socket's peer name gives it (IPv4-mapped IPv6 as IPv4); None where it is no IP
    address (a unix socket's peer)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return peer_of(address)


def peer_of(address: Address) -> str:
    """Whom a connection from ``address`` counts against, as text: an IPv4 address, or an IPv6 address's /64 (a
    host picks any address of its /64 at will, so a cap per IPv6 address would cap nothing)."""
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def established(ports: Iterable[int], tables: Iterable[str] = TCP_TABLES) -> list[tuple[int, int, Address]]:
    """``(local port, inode, peer address)`` of each established TCP connection to one of ``ports`` in this network
    namespace, any process's, read from /proc (where :func:`sockdiag.established` cannot ask the kernel)."""
    return _proc_rows(ports, tables, _ESTABLISHED)


def listening(ports: Iterable[int], tables: Iterable[str] = TCP_TABLES) -> list[tuple[int, int]]:
    """``(local port, inode)`` of each listening TCP socket on one of ``ports``, read from /proc (where
    :func:`sockdiag.listening` cannot ask the kernel)."""
    return [(port, inode) for port, inode, _ in _proc_rows(ports, tables, _LISTEN)]


def _proc_rows(ports: Iterable[int], tables: Iterable[str], state: str) -> list[tuple[int, int, Address]]:
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
                if len(fields) < 5 or fields[3] != state:
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


class SocketTables:
    """This network namespace's TCP sockets on given ports, any process's: asked of the kernel over netlink
    sock_diag, or, once the kernel refuses it (gVisor, a seccomp profile that forbids netlink, no inet_diag
    module), read from /proc/net/tcp and tcp6 from then on, said once in a WARNING. ``netlink`` False: /proc only."""

    def __init__(self, netlink: bool = True) -> None:
        self.netlink = netlink

    def established(self, ports: Iterable[int]) -> list[tuple[int, int, Address]]:
        """``(local port, inode, peer address)`` of each established connection to one of ``ports``."""
        return self._read(sockdiag.established, established, ports)

    def listening(self, ports: Iterable[int]) -> list[tuple[int, int]]:
        """``(local port, inode)`` of each listening socket on one of ``ports``."""
        return self._read(sockdiag.listening, listening, ports)

    def _read(
        self, ask: Callable[[Iterable[int]], list], parse: Callable[[Iterable[int]], list], ports: Iterable[int]
    ) -> list:
        if self.netlink:
            try:
                return ask(ports)
            except OSError as exc:
                self._refused(exc)
        return parse(ports)

    def _refused(self, exc: OSError) -> None:
        self.netlink = False
        log.warning(
            "connection cap reads /proc/net/tcp and tcp6: netlink sock_diag unavailable (%s); each check "
            'costs more as the network namespace\'s TCP tables grow (docs/overload.md, "Connections")',
            exc,
        )


# The process's tables: the per-peer cap and the drain read connections through it, and find out once.
SOCKETS = SocketTables()


def shut_down(fd: int, inode: int) -> bool:
    """Shut the connection on ``fd`` down both ways if ``fd`` is still the socket ``inode``; its owner closes it."""
    try:
        with borrowed(fd, inode) as connection:
            connection.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed meanwhile, the number now another connection's, or already gone
        return False
    return True


def unacknowledged_bytes(ports: Iterable[int]) -> int:
    """Bytes this process's connections on ``ports`` have sent that their peers have not acknowledged yet (each
    socket's SIOCOUTQ, the same request number as TIOCOUTQ): answers still on their way. Connections another
    process holds on a shared port are not counted."""
    mine = socket_inodes()
    pending = 0
    for _, inode, _ in SOCKETS.established(ports):
        fd = mine.get(inode)
        if fd is None:
            continue
        try:
            with borrowed(fd, inode) as connection:
                queued = fcntl.ioctl(connection.fileno(), termios.TIOCOUTQ, _INT.pack(0))
        except OSError:  # closed meanwhile
            continue
        pending += _INT.unpack(queued)[0]
    return pending


def connection_limits(config: ServiceConfig) -> dict[Port, int]:
    """Each port's own connection cap, as its server applies it in each process."""
    return {
        Port.GRPC: config.grpc_max_connections,
        Port.HEALTH: config.health_max_connections,
        Port.HTTP: config.http_max_connections,
        Port.HTTP_RPC: config.http_max_connections,
    }


class PeerCap:
    """At most ``cap`` established connections per peer on each of ``ports`` (local port -> its name) among this
    process's own; ``cap`` 0: no cap. :meth:`check` is one reading: a peer past the cap has its latest connections
    shut down, and a peer at the cap has its new ones dropped by the kernel before accept (:mod:`.listenfilter`)
    on the listeners of the port this process alone holds (not those of ``shared``, which other processes accept
    on too), until it holds fewer."""

    def __init__(
        self,
        cap: int,
        ports: Mapping[int, Port],
        metrics: PeerCapMetrics,
        tables: SocketTables = SOCKETS,
        shared: Iterable[int] = (),
        limits: Mapping[Port, int] | None = None,
    ) -> None:
        self.cap = cap
        self.tables = tables
        self.ports: dict[int, Port] = {}
        for port, name in ports.items():
            self.add_port(port, name)
        self.metrics = metrics
        self._shared = frozenset(shared)
        self.limits = dict(limits or {})  # each port's own connection cap, by name
        self._crowded: set[int] = set()  # the ports crowded at the last check
        self._seen: set[int] = set()  # the inodes of the last check's connections
        self._cutting_seconds = 0.0  # what the last check's shutdowns cost (_clock)
        self._listeners: dict[int, list[tuple[int, int]]] = {}  # port -> its listeners here, (fd, inode)
        self._looked: set[int] = set()  # the ports whose listeners were looked for
        self._sole: set[int] = set()  # the ports whose every listener in the network namespace is this process's
        self._watched: set[tuple[int, int]] = set()  # the listeners whose arrivals wake the checking thread
        self._dropping: dict[int, frozenset[str]] = {}  # port -> the peers its listeners' filter names
        self._drops: dict[tuple[int, int], int] = {}  # listener -> its sk_drops at the last reading
        self._filtering = True  # until the kernel refuses a filter
        self._log = RateLimitedLog(log, LOG_INTERVAL_SECONDS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-cap", daemon=True)

    def start(self) -> None:
        """Check on a daemon thread until :meth:`stop` (nothing to do without a cap)."""
        if self.cap > 0:
            self.tables.established(self.ports)  # the reader picked now: its fallback, if any, said at start
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        schedule = CheckSchedule()
        schedule.due = time.monotonic() + POLL_SECONDS
        with select.epoll() as arrivals:
            while True:
                self._watch(arrivals)
                arrived = arrivals.poll(max(0.0, schedule.due - time.monotonic()))
                # after an arrival, the rest of its burst lands meanwhile
                if self._stop.is_set() or (arrived and self._stop.wait(POLL_SECONDS)):
                    break
                now, fds = time.monotonic(), open_fds()
                if not schedule.is_due(now, fds):
                    continue
                started = _clock()
                try:
                    closed = self.check(fds)
                except Exception as exc:  # a /proc format it does not know: say so (rate-limited), keep serving
                    self._log.write(
                        "failed",
                        lambda count, exc=exc: log.error("connection cap check failed count=%d", count, exc_info=exc),
                    )
                    closed = 0
                schedule.checked(now, fds, _clock() - started - self._cutting_seconds, closed)

    def _watch(self, arrivals: select.epoll) -> None:
        """Have ``arrivals`` wake the checking thread when a connection reaches one of this process's own listeners
        (edge-triggered: once per burst that finds the accept queue empty). The owner's descriptor is registered
        as it is: the kernel forgets it once the owner closes it."""
        for listeners in list(self._listeners.values()):
            for listener in listeners:
                if listener not in self._watched:
                    self._watched.add(listener)
                    with contextlib.suppress(OSError):  # closed meanwhile: found again if its port has another
                        arrivals.register(listener[0], select.EPOLLIN | select.EPOLLET)

    def add_port(self, port: int, name: Port) -> None:
        """A port bound after start (a worker joins the gRPC port once warmed up)."""
        if self.ports.get(port, name) != name:  # two listeners on other addresses, the same number
            log.warning(
                "ports %s and %s share the number %d: their connections count together", self.ports[port], name, port
            )
        self.ports = {**self.ports, port: name}  # a new dict: the check thread reads it meanwhile

    def _find_listeners(self) -> None:
        """This process's own listeners of the ports whose new connections it may drop, each port's once."""
        ports = [port for port in self.ports if port not in self._shared and port not in self._looked]
        if not ports or not self._filtering:
            return
        self._looked.update(ports)
        mine = socket_inodes()
        theirs = set()
        for port, inode in self.tables.listening(ports):
            if inode in mine:
                self._listeners.setdefault(port, []).append((mine[inode], inode))
            else:
                theirs.add(port)
        self._sole.update(port for port in self._listeners if port in ports and port not in theirs)

    def _listener_gone(self, port: int) -> None:
        """A listener's descriptor holds something else: find the port's listeners again at the next check."""
        self._listeners.pop(port, None)
        self._sole.discard(port)
        self._dropping.pop(port, None)
        self._looked.discard(port)

    def _count_drops(self) -> None:
        """What the kernel dropped before accept on each listener since the last reading, counted by port."""
        for port, listeners in list(self._listeners.items()):
            for fd, inode in listeners:
                try:
                    now = listenfilter.drops(fd, inode)
                except OSError as exc:
                    if exc.errno in (errno.ESTALE, errno.EBADF):  # the listener closed, or its number reused
                        self._listener_gone(port)
                        break
                    return  # a kernel without SO_MEMINFO (before 4.12): nothing to count
                before = self._drops.get((fd, inode), 0)
                self._drops[fd, inode] = now
                if now > before:
                    self.metrics.connections_dropped_before_accept_total.labels(port=self.ports[port]).inc(now - before)

    def _drop_new_connections(self, at_cap: Mapping[int, Mapping[str, int]]) -> None:
        """Have the kernel drop new connections of the peers ``at_cap`` (port -> peer -> connections held), the
        :data:`listenfilter.MAX_PEERS` holding most on each port, and no longer those of the others."""
        if not self._filtering:
            return
        for port, listeners in list(self._listeners.items()):
            holding = at_cap.get(port, {})
            wanted = frozenset(sorted(holding, key=holding.__getitem__, reverse=True)[: listenfilter.MAX_PEERS])
            if wanted == self._dropping.get(port, frozenset()):
                continue
            program = listenfilter.program(wanted) if wanted else None
            try:
                for fd, inode in listeners:
                    if program is None:
                        listenfilter.detach(fd, inode)
                    else:
                        listenfilter.attach(fd, inode, program)
            except OSError as exc:
                if exc.errno == errno.ESTALE:
                    self._listener_gone(port)
                    continue
                self._filtering = False
                log.warning(
                    "connection cap cannot have the kernel drop a peer's new connections before accept (%s): a peer "
                    "past max_connections_per_peer has them accepted, then shut down "
                    '(docs/overload.md, "Connections")',
                    exc,
                )
                return
            name = self.ports[port]
            self._dropping[port] = wanted
            self.metrics.peers_at_connection_cap.labels(port=name).set(len(wanted))
            if wanted:
                worst, peers = max(wanted, key=holding.__getitem__), len(wanted)
                self._log.write(
                    ("dropping", name),
                    lambda count, name=name, peers=peers, worst=worst, held=holding[worst]: log.warning(
                        "peers at their connection cap: new connections dropped before accept port=%s peers=%d "
                        "worst_peer=%s held=%d max_connections_per_peer=%d count=%d",
                        name,
                        peers,
                        worst,
                        held,
                        self.cap,
                        count,
                    ),
                )

    def _limit_of(self, port: int) -> int:
        """The port's own connection cap (``grpc_max_connections`` and so on), 0 where none is known."""
        return self.limits.get(self.ports[port], 0)

    def _crowd_floor(self, port: int) -> float:
        return crowd_floor(self._limit_of(port), port in self._crowded)

    def _least_crowd(self) -> float:
        """The fewest descriptors with which a port could be crowded."""
        return min((self._crowd_floor(port) for port in self.ports), default=float("inf"))

    def check(self, fds: int) -> int:
        """With ``fds`` open descriptors: shut down each peer's connections past its share (the cap, or on a crowded
        port less), have the kernel drop new ones of each peer at it; how many were shut down. A peer's connections
        that were there at the last check are kept before those that came since (then by inode, roughly in the
        order they came: the kernel hands inodes out in blocks per CPU)."""
        self._cutting_seconds = 0.0
        if self.cap <= 0 or not self.ports:
            return 0
        self._find_listeners()
        self._count_drops()
        if fds <= min(self.cap, self._least_crowd()):
            self._seen, self._crowded = set(), set()
            self._drop_new_connections({})
            return 0  # no peer can hold as many connections as the process has descriptors, no port be crowded
        peers: dict[Address, str] = {}  # each remote address, read once per check
        # a set: a busy table may list a connection twice
        by_peer: dict[tuple[int, str], set[int]] = defaultdict(set)
        for port, inode, remote in self.tables.established(self.ports):
            peer = peers.get(remote)
            if peer is None:
                peer = peers[remote] = peer_of(remote)
            by_peer[port, peer].add(inode)
        seen, self._seen = self._seen, set().union(*by_peer.values())
        totals: dict[int, int] = defaultdict(int)  # every process's, so at least this one's
        for (port, _), inodes in by_peer.items():
            totals[port] += len(inodes)
        crowding = {port for port, total in totals.items() if total >= self._crowd_floor(port)}
        wanted = {key: inodes for key, inodes in by_peer.items() if len(inodes) >= self.cap or key[0] in crowding}
        if not wanted:
            self._crowded = set()
            self._drop_new_connections({})
            return 0
        # What each peer holds here. Where every listener of a port is this process's, every connection there is its
        # own (or waits in its accept queue): the kernel's count, known without listing the descriptors (an fstat
        # each, which under load wait on the GIL one by one while the flood goes on), so that the filter goes on
        # before the listing. Elsewhere (a port other processes listen on too), its own descriptors'.
        held = {key: len(inodes) for key, inodes in wanted.items() if key[0] in self._sole}
        mine = None
        if len(held) < len(wanted):
            mine = socket_inodes()
            for key, inodes in wanted.items():
                if key not in held:
                    held[key] = sum(inode in mine for inode in inodes)
        shares = self._shares(crowding, held)
        at_cap: dict[int, dict[str, int]] = defaultdict(dict)  # port -> peer -> connections held here
        for (port, peer), count in held.items():
            if count >= shares.get(port, self.cap):
                at_cap[port][peer] = count
        self._drop_new_connections(at_cap)  # first: a flood's connections stop coming while it is cut
        over = [key for key, count in held.items() if count > shares.get(key[0], self.cap)]
        if not over:
            return 0
        if mine is None:
            mine = socket_inodes()
        own: dict[tuple[int, str], list[int]] = {}  # (port, peer) -> its connections here, the kept ones first
        for key in over:
            own[key] = sorted(
                (inode for inode in wanted[key] if inode in mine), key=lambda inode: (inode not in seen, inode)
            )
        cut: dict[int, list[tuple[int, str, int]]] = defaultdict(list)  # port -> (held, peer, closed)
        cutting = _clock()
        for (port, peer), connections in own.items():
            closed = sum(shut_down(mine[inode], inode) for inode in connections[shares.get(port, self.cap) :])
            if closed:
                cut[port].append((len(connections), peer, closed))
        self._cutting_seconds = _clock() - cutting
        total = 0
        for port, peers_cut in cut.items():
            name, closed = self.ports[port], sum(closed for _, _, closed in peers_cut)
            total += closed
            self.metrics.peer_connections_closed_total.labels(port=name).inc(closed)
            held, worst, _ = max(peers_cut)
            peers_over, share = len(peers_cut), shares.get(port, self.cap)
            self._log.write(  # per port, not per peer: many peers make one line, not many
                name,
                lambda count, name=name, peers=peers_over, worst=worst, held=held, share=share, closed=closed: (
                    log.warning(
                        "peers over their connection cap port=%s peers=%d worst_peer=%s held=%d share=%d "
                        "max_connections_per_peer=%d closed=%d count=%d",
                        name,
                        peers,
                        worst,
                        held,
                        share,
                        self.cap,
                        closed,
                        count,
                    )
                ),
            )
        return total

    def _shares(self, crowding: set[int], held: Mapping[tuple[int, str], int]) -> dict[int, int]:
        """Each crowded port's share per peer (the others': the cap): CROWDED_SHARE of its cap over the peers that
        hold its connections here (``held``: (port, peer) -> how many), at least 1 and at most the cap; which ports
        are crowded is kept for the next check (a port stays crowded until under UNCROWDED of its cap)."""
        totals: dict[int, int] = defaultdict(int)
        peers: dict[int, int] = defaultdict(int)
        for (port, _), count in held.items():
            if port in crowding and count:
                totals[port] += count
                peers[port] += 1
        was, self._crowded = self._crowded, {port for port in crowding if totals[port] >= self._crowd_floor(port)}
        shares = {}
        for port in self._crowded:
            limit = self._limit_of(port)
            shares[port] = crowded_share(limit, self.cap, peers[port])
            if port not in was:
                name = self.ports[port]
                self._log.write(
                    ("crowded", name),
                    lambda count, name=name, held=totals[port], limit=limit, peers=peers[port], share=shares[port]: (
                        log.warning(
                            "port crowded: each peer held to its share port=%s connections=%d limit=%d peers=%d "
                            "share=%d count=%d",
                            name,
                            held,
                            limit,
                            peers,
                            share,
                            count,
                        )
                    ),
                )
        return shares
