"""The gRPC ports' options and credentials: message limits, streams per connection, connection age, the bounds on
connections (count, handshake, idle, keepalive), whether the port is shared, and the TLS credentials."""

from __future__ import annotations

from pathlib import Path

import grpc

from indexer_service.service.config import ServiceConfig
from indexer_service.service.overload.limits import max_request_bytes


def connection_age_options(seconds: float) -> list[tuple[str, int]]:
    """Ask clients to reconnect after ``seconds``, so they re-resolve DNS and spread onto new replicas; calls
    in flight then get 10 s to finish (``grpc.max_connection_age_grace_ms``, fixed: not ``shutdown_grace_seconds``)."""
    if seconds <= 0:
        return []
    return [("grpc.max_connection_age_ms", int(seconds * 1000)), ("grpc.max_connection_age_grace_ms", 10_000)]


# Keepalive, enforced: a client may ping at most every 10 s while it has no call (gRPC's default is 5 min, which
# turns away clients that keep connections warm every 30-60 s); the third ping too early (gRPC's default 2
# strikes) gets GOAWAY ENHANCE_YOUR_CALM, so pings cannot be a flood of their own. The server pings a connection
# that carries calls every minute and closes it when the peer does not answer within 20 s: a peer that vanished
# (no FIN, no RST) while it held a Watch stream or a stalled call lets go of it then, not at max_connection_age.
KEEPALIVE_OPTIONS = [
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
]


def connection_options(config: ServiceConfig, max_connections: int) -> list[tuple[str, int]]:
    """What bounds a port's connections (docs/overload.md, "Connections"): at most ``max_connections`` open
    (gRPC core closes more at accept; TLS handshakes in progress count), each handshake (TLS, then the client's
    HTTP/2 settings) done within ``handshake_timeout_seconds``, a connection with no call closed after
    ``connection_idle_seconds``, and keepalive enforced."""
    options = [
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", int(config.handshake_timeout_seconds * 1000)),
        *KEEPALIVE_OPTIONS,
    ]
    if config.connection_idle_seconds > 0:
        options.append(("grpc.max_connection_idle_ms", int(config.connection_idle_seconds * 1000)))
    return options


def server_options(config: ServiceConfig, share_port: bool = False) -> list[tuple[str, int]]:
    """The gRPC server's channel options: message limits both ways (a request is never larger than a valid one
    can be), streams per connection, pending calls, no shared port (but between the workers of one replica,
    ``share_port``: the supervisor has reserved the port for them, service/process/supervisor.py), connection age, and
    the bounds on connections."""
    return [
        ("grpc.max_receive_message_length", max_request_bytes(config)),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_concurrent_streams", config.max_streams_per_connection),
        # Never share a port silently with another process (Linux allows it by default in gRPC); the workers of
        # one replica share theirs on purpose, and the supervisor guards it against anyone else.
        ("grpc.so_reuseport", int(share_port)),
        *connection_age_options(config.max_connection_age_seconds),
        *connection_options(config, config.grpc_max_connections),
    ]


def server_credentials(config: ServiceConfig) -> grpc.ServerCredentials | None:
    """TLS credentials of the gRPC port, requiring client certificates when a client CA is configured."""
    if not config.tls_enabled:
        return None
    client_ca = Path(config.tls_client_ca_file).read_bytes() if config.tls_client_ca_file else None
    return grpc.ssl_server_credentials(
        [(Path(config.tls_key_file).read_bytes(), Path(config.tls_cert_file).read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )
