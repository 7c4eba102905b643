"""A Python client for schedulers: numpy arrays in and out, deadlines, retries, round-robin over replicas.

    with IndexerClient("dns:///indexer-headless.indexer.svc.cluster.local:50051") as client:
        meta = client.build_chunk(ChunkInputs(qsl, seq_lens, compress_ratio=4, req_start=1, req_end=3))
        plan = client.plan_batch(BatchInputs(qsl, seq_lens, 4, num_decodes=1, max_model_len=1 << 20))

Retries and load balancing live in the gRPC service config, not in Python loops: every RPC is idempotent, so
UNAVAILABLE (a replica warming up, draining, or gone) is retried with backoff on another replica, within the
call's deadline, and so is CANCELLED: a caller never sees its own cancellation come back, and a server that
shuts down answers CANCELLED to calls it had received but not yet handed to a handler (grpc/grpc#41785).
Round-robin spreads calls over every address a target resolves to, and client-side health
checking keeps calls off replicas that are not SERVING. Failed calls raise ``grpc.RpcError``.

Targets: a string is a gRPC target used as is (``host:port``, ``dns:///name:port``, ``ipv4:a:p1,b:p2``). A list
is ``host:port`` items: IP literals (``10.0.0.1:50051``, ``[fd00::1]:50051``, one family) become one
``ipv4:``/``ipv6:`` target; one host name (``["localhost:50051"]``) becomes ``dns:///localhost:50051`` (every
address it resolves to, re-resolved as replicas come and go). Several host names in one list are refused with
a ValueError: give one DNS name that resolves to every replica (a Kubernetes headless Service), or literals.

Several connections: a replica runs several worker processes sharing one port (docs/service.md, "Workers"), and
the kernel hands each *connection* to one of them, so one connection would reach one worker. The client opens
``connections`` channels (8 by default), each its own connection to every address, and sends each call on the
one with the fewest calls in flight (ties in turn): calls flow to the workers that answer, and a worker that no
connection reached costs nothing but its share. The kernel picks a worker per connection at random: 8
connections leave one of 2 workers without any with probability 2 / 2^8 (under 1 %); ask for more on replicas
with many workers.

Wait for ready: ``build_chunk`` and ``plan_batch`` wait, within the call's deadline, for a replica to be connected and
SERVING (gRPC's ``wait_for_ready``), so a scheduler that starts beside replicas still warming up gets its answer once
one is ready instead of UNAVAILABLE at once. ``IndexerClient(..., wait_for_ready=False)`` fails fast instead: with no
server to connect to, UNAVAILABLE naming the address and why (connection refused, an HTTP/1.x server, ...) within the
retry policy's backoff. ``health`` and ``warmup_status`` never wait: they report on the server as it is now.

Reconnecting: a connection that fails is tried again after a backoff that gRPC grows by 1.6x an attempt (with +-20 %
jitter) up to ``max_reconnect_backoff_seconds`` (5 s by default; gRPC's own bound, 120 s, can leave a client minutes
behind a server that is back). The same bound is the least time between two DNS re-resolutions; a resolution that
fails (a name with no address while every replica is down) is retried on gRPC's own backoff, up to 120 s, which no
channel option changes.

Metadata: ``IndexerClient(..., metadata=...)`` is sent with every call, each method's ``metadata=`` with that call
(its keys replace the client's): a request id (``x-request-id``, which the server logs and returns in the trailing
metadata, ``grpc.RpcError.trailing_metadata()`` on a failure), a W3C ``traceparent`` that the server's span takes as
its parent. Keys are sent in lowercase; keys and values are checked when given (header names, printable ASCII
values, ``bytes`` for ``-bin`` keys): a ValueError naming the entry, not an INTERNAL "Invalid metadata" from the call.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import math
import re
import threading
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from indexer_service.kernels.inputs import ChunkInputs, ChunkMetadata
from indexer_service.kernels.planner import BatchInputs, PrefillPlan
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.protos.indexer.v1 import indexer_pb2_grpc as pb_grpc
from indexer_service.service import codec
from indexer_service.service.codec import SERVICE_NAME
from indexer_service.service.process.addresses import TARGET_SCHEMES, split_host_port

DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20  # the server's default max_message_bytes
DEFAULT_TIMEOUT_SECONDS = 10.0
DEFAULT_CONNECTIONS = 8  # per address: see the module docstring
DEFAULT_MAX_RECONNECT_BACKOFF_SECONDS = 5.0  # see the module docstring

# gRPC metadata: (key, value) pairs; a value is str, or bytes for a key ending in "-bin".
Metadata = Sequence[tuple[str, str | bytes]]


def channel_target(addresses: str | Sequence[str]) -> str:
    """A gRPC target: a string is used as is (``host:port``, ``dns:///name:port``, ``ipv4:a:p1,b:p2``); a list
    of ``host:port`` IP literals becomes one ``ipv4:`` or ``ipv6:`` target that round-robin spreads over, a list
    of one host name (or one target with a scheme) a ``dns:///`` target. See the module docstring."""
    if isinstance(addresses, str):
        return addresses
    addresses = list(addresses)
    if not addresses:
        raise ValueError("no server address given")
    if any(a.startswith(TARGET_SCHEMES) for a in addresses):
        if len(addresses) > 1:
            raise ValueError(f"a target with a scheme stands alone, got {addresses!r}")
        return addresses[0]
    families: set[int] = set()
    names: list[str] = []
    for address in addresses:
        host, port = split_host_port(address)
        try:
            families.add(ipaddress.ip_address(host).version)
        except ValueError:
            names.append(f"{host}:{port}")
    if names:
        if len(addresses) > 1:
            raise ValueError(
                f"several addresses with host names ({', '.join(names)}) cannot share one channel: give one DNS "
                "name that resolves to every replica, as 'dns:///name:port' (e.g. a headless Service), or IP "
                "literals"
            )
        return f"dns:///{names[0]}"
    if len(families) > 1:
        raise ValueError(f"IPv4 and IPv6 literals cannot share one channel, got {addresses!r}")
    return f"ipv{families.pop()}:{','.join(addresses)}"


# What gRPC accepts as a metadata key (an HTTP/2 header name, lowercase; "grpc-" names are gRPC's own) and as a text
# value (printable ASCII): checked before sending, as gRPC refuses a bad entry only at the call, with INTERNAL
# "Invalid metadata", which reads like the server's fault.
_METADATA_KEY = re.compile(r"[0-9a-z_.-]+")
_METADATA_TEXT = re.compile(r"[\x20-\x7e]*")


def checked_metadata(metadata: Metadata | None) -> tuple[tuple[str, str | bytes], ...]:
    """``metadata`` as a tuple of ``(key, value)`` pairs, keys in lowercase (header names are case-insensitive and
    HTTP/2 sends them so), each checked as gRPC will check it; a ValueError naming the first entry gRPC would
    refuse."""
    entries = []
    for entry in metadata or ():
        if not (isinstance(entry, tuple | list) and len(entry) == 2 and isinstance(entry[0], str)):
            raise ValueError(f"metadata: each entry is a (key, value) pair with a str key, got {entry!r}")
        key, value = entry[0].lower(), entry[1]
        entries.append((key, value))
        if not _METADATA_KEY.fullmatch(key) or key.startswith("grpc-"):
            raise ValueError(
                f"metadata key {key!r}: letters, digits, '-', '_' and '.' only, not starting with 'grpc-' (gRPC's own)"
            )
        if key.endswith("-bin"):
            if not isinstance(value, bytes):
                raise ValueError(f"metadata {key!r}: a key ending in '-bin' takes bytes, got {type(value).__name__}")
        elif not isinstance(value, str) or not _METADATA_TEXT.fullmatch(value):
            raise ValueError(f"metadata {key!r}: the value must be a str of printable ASCII, got {value!r}")
    return tuple(entries)


def merged_metadata(
    defaults: tuple[tuple[str, str | bytes], ...], metadata: Metadata | None
) -> tuple[tuple[str, str | bytes], ...]:
    """The client's ``defaults`` with a call's ``metadata`` (checked) after them; a key the call gives replaces every
    entry of the defaults under that key."""
    if not metadata:
        return defaults
    call = checked_metadata(metadata)
    given = {key for key, _ in call}
    return tuple(entry for entry in defaults if entry[0] not in given) + call


def reconnect_options(max_backoff_seconds: float | None) -> list[tuple[str, int]]:
    """Channel options that bound the wait between connection attempts (and between DNS re-resolutions after a
    failed connection) to ``max_backoff_seconds``, with gRPC's +-20 % jitter; None: gRPC's defaults (a backoff
    that grows to 120 s, re-resolution at most every 30 s)."""
    if max_backoff_seconds is None:
        return []
    if not (math.isfinite(max_backoff_seconds) and max_backoff_seconds > 0):
        raise ValueError(f"max_reconnect_backoff_seconds: must be a finite number > 0, got {max_backoff_seconds}")
    cap_ms = max(100, round(max_backoff_seconds * 1000))  # gRPC waits at least 100 ms whatever it is given
    return [
        ("grpc.max_reconnect_backoff_ms", cap_ms),
        # gRPC caps the attempts after the first: its first wait (1 s) must not exceed a smaller cap either.
        ("grpc.initial_reconnect_backoff_ms", min(1000, cap_ms)),
        ("grpc.dns_min_time_between_resolutions_ms", cap_ms),
    ]


def service_config(max_attempts: int = 5, health_check: bool = True) -> str:
    """The channel's service config: round-robin, retry of UNAVAILABLE and CANCELLED with backoff
    (``max_attempts`` calls in all; 1: no retry), optional client-side health checks."""
    method: dict[str, object] = {"name": [{"service": SERVICE_NAME}]}
    if max_attempts > 1:  # gRPC rejects a whole service config whose retryPolicy has maxAttempts < 2
        method["retryPolicy"] = {
            "maxAttempts": max_attempts,
            "initialBackoff": "0.05s",
            "maxBackoff": "1s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"],
        }
    config: dict[str, object] = {"loadBalancingConfig": [{"round_robin": {}}], "methodConfig": [method]}
    if health_check:
        config["healthCheckConfig"] = {"serviceName": SERVICE_NAME}
    return json.dumps(config)


def tls_credentials(
    ca_file: str | Path | None, cert_file: str | Path | None = None, key_file: str | Path | None = None
) -> grpc.ChannelCredentials:
    """Credentials for a server whose certificate chains to ``ca_file`` (None: the system's trusted roots);
    with a client certificate and key, for a server that requires mutual TLS."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate and its key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca_file).read_bytes() if ca_file else None,
        private_key=Path(key_file).read_bytes() if key_file else None,
        certificate_chain=Path(cert_file).read_bytes() if cert_file else None,
    )


class ChannelPool:
    """``size`` channels to one target, each its own connection to every address the target resolves to
    (gRPC would otherwise share one connection per address between channels); :meth:`acquire` gives the index of
    the one with the fewest calls in flight, the ties in turn, and :meth:`release` gives it back once the call is
    over (``try``/``finally``, as :meth:`IndexerClient._call`)."""

    def __init__(self, make_channel, size: int) -> None:
        if size < 1:
            raise ValueError(f"connections: must be >= 1, got {size}")
        self.channels = [make_channel([("grpc.use_local_subchannel_pool", 1)]) for _ in range(size)]
        self._in_flight = [0] * size
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def acquire(self) -> int:
        size = len(self.channels)
        with self._lock:
            start = next(self._turn) % size
            best = min(range(start, start + size), key=lambda i: self._in_flight[i % size]) % size
            self._in_flight[best] += 1
        return best

    def release(self, index: int) -> None:
        with self._lock:
            self._in_flight[index] -= 1

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


class IndexerClient:
    """Channels to one or several servers (``connections`` of them: see the module docstring).

    ``health_check=False`` sends calls to replicas that are not SERVING too (what ``indexer-service check``
    needs to ask a warming server for its status). ``credentials`` (see :func:`tls_credentials`) makes the
    channel TLS. ``wait_for_ready`` (default on): ``build_chunk`` and ``plan_batch`` wait within their deadline
    for a connected, SERVING replica instead of failing UNAVAILABLE at once. ``max_reconnect_backoff_seconds``
    bounds the wait between connection attempts (None: gRPC's 120 s). ``metadata`` goes with every call, before
    (and replaced key by key by) a call's own ``metadata=``.
    """

    def __init__(
        self,
        target: str | Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_attempts: int = 5,
        health_check: bool = True,
        wait_for_ready: bool = True,
        credentials: grpc.ChannelCredentials | None = None,
        connections: int = DEFAULT_CONNECTIONS,
        max_reconnect_backoff_seconds: float | None = DEFAULT_MAX_RECONNECT_BACKOFF_SECONDS,
        metadata: Metadata = (),
    ) -> None:
        self.timeout = timeout
        self.wait_for_ready = wait_for_ready
        self.metadata = checked_metadata(metadata)
        options = [
            ("grpc.service_config", service_config(max_attempts, health_check)),
            ("grpc.enable_retries", 1),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            *reconnect_options(max_reconnect_backoff_seconds),
        ]
        target = channel_target(target)
        self.target = target

        def make_channel(extra: list[tuple[str, object]]) -> grpc.Channel:
            if credentials is not None:
                return grpc.secure_channel(target, credentials, options=options + extra)
            return grpc.insecure_channel(target, options=options + extra)

        self.pool = ChannelPool(make_channel, connections)
        self.stubs = [pb_grpc.PrefillMetadataStub(c) for c in self.pool.channels]
        self.channel = self.pool.channels[0]
        self.stub = self.stubs[0]
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> IndexerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self.pool.close()

    def _call(self, method: str, request: object, timeout: float | None, metadata: Metadata | None) -> object:
        sent = merged_metadata(self.metadata, metadata)
        index = self.pool.acquire()
        try:
            return getattr(self.stubs[index], method)(
                request, timeout=timeout or self.timeout, metadata=sent, wait_for_ready=self.wait_for_ready
            )
        finally:
            self.pool.release(index)

    def build_chunk(
        self,
        inputs: ChunkInputs,
        *,
        omit_token_to_seq: bool = False,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> ChunkMetadata | None:
        """One chunk's metadata; None when the chunk holds no compressed token. ``token_to_seq`` is None when
        omitted."""
        request = codec.chunk_inputs_to_proto(inputs, omit_token_to_seq)
        response = self._call("BuildChunk", request, timeout, metadata)
        return codec.metadata_from_proto(response.metadata) if response.HasField("metadata") else None

    def plan_batch(
        self,
        batch: BatchInputs,
        *,
        omit_token_to_seq: bool = False,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> PrefillPlan:
        """The batch's prefill chunk plan and the metadata of every non-empty chunk."""
        request = codec.batch_inputs_to_proto(batch, omit_token_to_seq)
        return codec.plan_from_proto(self._call("PlanBatch", request, timeout, metadata))

    def warmup_status(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> pb.GetWarmupStatusResponse:
        """The warmup's progress; never waits for a ready server (use ``health_check=False`` to ask one that is
        warming up)."""
        return self.stub.GetWarmupStatus(
            pb.GetWarmupStatusRequest(),
            timeout=timeout or self.timeout,
            metadata=merged_metadata(self.metadata, metadata),
        )

    def health(
        self, service: str = SERVICE_NAME, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> str:
        """``SERVING``, ``NOT_SERVING`` or ``SERVICE_UNKNOWN`` from grpc.health.v1 Check."""
        response = self.health_stub.Check(
            health_pb2.HealthCheckRequest(service=service),
            timeout=timeout or self.timeout,
            metadata=merged_metadata(self.metadata, metadata),
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
