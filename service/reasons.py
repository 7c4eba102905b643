"""The reasons the service counts and logs its refusals and restarts by, each vocabulary defined once.

Each is a ``StrEnum``: a member is its own string, so metric labels (``indexer_requests_shed_total{reason}``,
``indexer_http_refused_total{reason}``, ``indexer_worker_restarts_total{reason}``) and log lines (``reason=...``)
read the same words dashboards, alerts (deploy/prometheus/indexer.rules.yml) and runbooks match on. Every
series of a reason is pre-created from these (service/observability/metrics.py, service/dataplane.py), so a reason shows
as 0 before it first happens. This module imports nothing of the service: every layer may use it.
"""

from __future__ import annotations

from enum import StrEnum


class ShedReason(StrEnum):
    """Why the server refused or cut a call to protect itself (indexer_requests_shed_total's reason label)."""

    CONCURRENCY = "concurrency"  # max_concurrent_rpcs calls already in the server
    MEMORY = "memory"  # the response budget stayed full for admission_wait_seconds
    CONNECTION_SHARE = "connection_share"  # the call's connection held its share of the budget in unread answers
    HEAVY_LANE = "heavy_lane"  # every heavy-lane slot stayed busy for admission_wait_seconds
    WORK_LIMIT = "work_limit"  # the request's work is above a limit (max_plan_chunks, response_budget_bytes)
    QUEUE_DEADLINE = "queue_deadline"  # the call's deadline passed while it waited in the server (its request in)
    DEADLINE_ON_ARRIVAL = "deadline_on_arrival"  # the call's deadline had passed before its request was in
    CALLER_CANCELLED = "caller_cancelled"  # its caller cancelled or reset the call before it started
    SHUTDOWN = "shutdown"  # still running when the shutdown grace ended
    UNREAD_RESPONSE = "unread_response"  # the caller did not read its response (or a health watcher its status)
    STREAM_LIMIT = "stream_limit"  # a Watch or reflection stream over its per-connection or total cap (streams.py)
    IDLE_STREAM = "idle_stream"  # a reflection stream that waited reflection_idle_seconds for a request
    PEER_SHARE = "peer_share"  # one peer (an address, an IPv6 /64) already holds its share of a port's calls
    REQUEST_TIMEOUT = "request_timeout"  # a call whose request message did not come within request_timeout_seconds
    UNDECODABLE = "undecodable"  # a request message that does not parse (health, reflection; RPCs: INVALID_ARGUMENT)


class HttpRefusal(StrEnum):
    """Why an HTTP port refused a connection or a request (indexer_http_refused_total's reason label)."""

    HEADER_TOO_LARGE = "header_too_large"  # a request head above http_max_header_bytes
    IDLE_TIMEOUT = "idle_timeout"  # idle for http_idle_timeout_seconds: closed (counted, not logged)
    TOO_MANY_CONNECTIONS = "too_many_connections"  # a connection above a port's http_max_connections
    PEER_SHARE = "peer_share"  # a connection of a peer holding its share of the port (max_connections_per_peer)
    BODY_TOO_LARGE = "body_too_large"  # a body larger than any request within the server's limits
    RPC_ON_METRICS_PORT = "rpc_on_metrics_port"  # an RPC posted to http_port: a client set up for an older layout


class RestartReason(StrEnum):
    """Why a worker process was restarted (indexer_worker_restarts_total's reason label)."""

    EXIT = "exit"  # it exited by itself (a fatal error, or a SIGTERM not from the supervisor)
    KILLED = "killed"  # a signal ended it (the OOM killer's SIGKILL, a segfault...)
    HUNG = "hung"  # it did not answer the supervisor's probes for worker_hang_seconds: the supervisor killed it


class Port(StrEnum):
    """The ports a process serves, by name (indexer_peer_connections_closed_total's port label, and the
    ``port=`` of the connection cap's log line)."""

    GRPC = "grpc"
    HEALTH = "health"
    HTTP = "http"
    HTTP_RPC = "http_rpc"


# The shed reasons that are the service's own overload (too little capacity for the traffic it was sent): the only ones
# the shedding alerts page for (deploy/prometheus/indexer.rules.yml; a test holds the rules to this set). The others
# are callers' behaviour (a limit, a caller that left or sent nothing, a flood) or the service's own drain (shutdown).
OVERLOAD_REASONS = frozenset(
    {ShedReason.CONCURRENCY, ShedReason.MEMORY, ShedReason.HEAVY_LANE, ShedReason.QUEUE_DEADLINE}
)
