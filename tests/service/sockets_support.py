"""Real listening sockets of the test process, for the tests that read or filter its connections over loopback."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


def ipv6_loopback() -> bool:
    """Whether [::1] can be bound here (some containers have no IPv6)."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@contextmanager
def listener(host: str = "127.0.0.1", v6only: bool = True) -> Iterator[socket.socket]:
    """A socket listening on ``host`` at a free port; ``host`` "::" with ``v6only`` false takes IPv4 clients too."""
    server = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    if ":" in host:
        server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
    server.bind((host, 0))
    server.listen(64)
    with server:
        yield server
