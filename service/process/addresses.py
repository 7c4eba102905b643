"""Network addresses as the service writes and reads them: ``host:port``, an IPv6 literal in brackets. One
writer and one reader for the servers, the client, the CLI and the test kit."""

from __future__ import annotations

# The gRPC target schemes (``dns:///name:port``, ``ipv4:a:p1,b:p2``, ``unix:path`` ...): a target that starts with one
# is not a ``host:port``.
TARGET_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:", "vsock:", "xds:")


def host_port(host: str, port: int) -> str:
    """``host:port``, or ``[host]:port`` for an IPv6 literal (it has colons of its own)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` split, without the brackets; a ValueError naming ``address`` for anything
    else (an IPv6 literal without brackets, a port out of range, a target with a scheme)."""
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
    else:
        host, sep, port = address.rpartition(":")
        if ":" in host:
            raise ValueError(f"{address!r}: write an IPv6 address in brackets, [addr]:port")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{address!r}: expected host:port")
    return host, int(port)
