"""Listening sockets, bound before anything serves: a port that cannot be had stops the start with one line naming
it, and a supervisor binds them once for all its workers, which inherit them (service/process/supervisor.py)."""

from __future__ import annotations

import socket

from indexer_service.service.config import ServiceConfig
from indexer_service.service.process.addresses import host_port
from indexer_service.service.process.workerproto import SHARED_LISTENERS

BACKLOG = 1024


def socket_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple]:
    """The address family and the address tuple ``bind`` takes for ``host`` (an IPv6 literal has a colon)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return family, ((host, port, 0, 0) if family == socket.AF_INET6 else (host, port))


def bind_tcp(host: str, port: int, what: str, option: int | None = None) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: any free port) with the SOL_SOCKET ``option`` set (SO_REUSEADDR,
    SO_REUSEPORT; None: no option), or OSError "cannot bind <what> to host:port"."""
    family, address = socket_address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    if option is not None:
        sock.setsockopt(socket.SOL_SOCKET, option, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind {what} to {host_port(host, port)}: {exc}") from None
    return sock


def listen_tcp(host: str, port: int, what: str) -> socket.socket:
    """A TCP socket listening on ``host:port`` (0: any free port), or OSError "cannot bind <what> to host:port"."""
    sock = bind_tcp(host, port, what, socket.SO_REUSEADDR)
    sock.listen(BACKLOG)
    return sock


def bind_shared(config: ServiceConfig) -> dict[str, socket.socket]:
    """Every listener of :data:`~indexer_service.service.process.workerproto.SHARED_LISTENERS` that ``config`` turns on,
    listening, by name: what a single process serves on, and what a supervisor binds once for its workers."""
    sockets = {}
    for name, listener in SHARED_LISTENERS.items():
        if listener.enabled_by is None or getattr(config, listener.enabled_by):
            host, port = getattr(config, listener.host_setting), getattr(config, listener.port_setting)
            sockets[name] = listen_tcp(host, port, listener.what)
    return sockets
