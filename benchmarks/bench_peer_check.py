"""What one check of the per-peer connection cap costs (service/overload/peers.py), with each reader of the
established connections: netlink sock_diag (service/overload/sockdiag.py) and /proc/net/tcp{,6}:

    unshare -n sh -c 'ip link set lo up && python -m benchmarks.bench_peer_check [--connections N]
        [--time-wait N] [--rounds N] [--out FILE]'

This process accepts ``--connections`` (15,000) connections on one port from two peers (127.0.0.2 and 127.0.0.3,
half each: under a cap of half, so a check reads everything and cuts nothing), which a child process opens and
holds, after leaving ``--time-wait`` (20,000: each stays 60 s, so all are still there when it reads) sockets in
TIME_WAIT on another port, as a reconnecting flood does. It prints, per reader, a read of the port's connections
and a whole :meth:`PeerCap.check` (median and worst of ``--rounds``, wall and thread CPU time), and the read of
this process's own sockets (/proc/self/fd) that a check which cuts adds. Run it in a network namespace of its own
(``unshare -n``, as root): the TIME_WAIT sockets stay 60 s and every other reader of the namespace's tables would
pay for them.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry

from indexer_service.service.observability.metrics import PeerCapMetrics
from indexer_service.service.overload import peers, sockdiag
from indexer_service.service.reasons import Port
from testkit.record import write_json

PEERS = ("127.0.0.2", "127.0.0.3")


def leave_time_wait(count: int) -> None:
    """``count`` connections closed by their client first, which keeps them in TIME_WAIT for 60 s; from several
    source addresses, each with its own ephemeral ports."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4096)
        for start in range(0, count, 1000):
            clients = []
            for index in range(start, min(count, start + 1000)):
                client = socket.socket()
                client.bind((f"127.0.1.{1 + index // 20_000}", 0))
                client.connect(server.getsockname())
                clients.append(client)
            accepted = [server.accept()[0] for _ in clients]
            for sock in clients + accepted:
                sock.close()


def hold_connections(address: tuple[str, int], count: int) -> tuple[int, int]:
    """A child process that opens ``count`` connections to ``address`` and holds them until its pipe closes:
    (its pid, the pipe's write end)."""
    ready_read, ready_write = os.pipe()
    stop_read, stop_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: connect, say so, wait, exit without running the parent's cleanups
        try:
            os.close(stop_write)  # else its own copy would keep the pipe open after the parent closes it
            os.close(ready_read)
            held = []
            for index in range(count):
                client = socket.socket()
                client.bind((PEERS[index % len(PEERS)], 0))
                client.connect(address)
                held.append(client)
            os.write(ready_write, b"x")
            os.read(stop_read, 1)
        finally:
            os._exit(0)
    os.close(ready_write)
    os.close(stop_read)
    threading.Thread(target=os.read, args=(ready_read, 1), daemon=True).start()
    return pid, stop_write


def timed(function: Callable[[], object], rounds: int) -> dict:
    """Median and worst wall and thread-CPU milliseconds of ``rounds`` calls."""
    walls, cpus = [], []
    for _ in range(rounds):
        wall, cpu = time.perf_counter(), time.thread_time()
        function()
        cpus.append((time.thread_time() - cpu) * 1000)
        walls.append((time.perf_counter() - wall) * 1000)
    return {
        "wall_ms_median": round(statistics.median(walls), 2),
        "wall_ms_max": round(max(walls), 2),
        "cpu_ms_median": round(statistics.median(cpus), 2),
        "cpu_ms_max": round(max(cpus), 2),
    }


def tcp_rows() -> dict[str, int]:
    """The namespace's TCP sockets by state, as /proc lists them (01 established, 06 TIME_WAIT)."""
    states: dict[str, int] = {}
    for table in peers.TCP_TABLES:
        with open(table) as lines:
            next(lines)
            for line in lines:
                state = line.split(None, 4)[3]
                states[state] = states.get(state, 0) + 1
    return states


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=15_000)
    parser.add_argument("--time-wait", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    leave_time_wait(args.time_wait)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4096)
    port = listener.getsockname()[1]
    pid, stop = hold_connections(listener.getsockname(), args.connections)
    accepted = [listener.accept()[0] for _ in range(args.connections)]
    try:
        rows = tcp_rows()
        figures: dict = {
            "python": sys.version.split()[0],
            "connections": args.connections,
            "tcp_rows": sum(rows.values()),
            "established_rows": rows.get("01", 0),
            "time_wait_rows": rows.get("06", 0),
            "own_fds": peers.open_fds(),
        }
        metrics = PeerCapMetrics(CollectorRegistry())
        for name, read in (("sock_diag", sockdiag.established), ("proc", peers.established)):
            assert len(read([port])) == args.connections, name
            cap = peers.PeerCap(args.connections // len(PEERS), {port: Port.GRPC}, metrics, read=read)
            figures[name] = {
                "read": timed(lambda read=read: read([port]), args.rounds),
                "check": timed(lambda cap=cap: cap.check(peers.open_fds()), args.rounds),
            }
        figures["own_sockets"] = timed(peers.socket_inodes, args.rounds)
    finally:
        os.close(stop)
        os.waitpid(pid, 0)
        for sock in accepted:
            sock.close()
        listener.close()
    for key, value in figures.items():
        print(f"{key}: {value}")
    if args.out:
        write_json(args.out, figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
