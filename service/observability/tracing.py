"""OpenTelemetry tracing of the RPCs: a server span per call, named after its method, child of the caller's W3C
``traceparent`` (and ``tracestate``), with the status code and the request id as attributes.

Configured only by the standard ``OTEL_*`` variables, read by the OpenTelemetry SDK itself: tracing is on when
``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``; ``otlp`` speaks gRPC, or HTTP with
``OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf``) and ``OTEL_SDK_DISABLED`` is not ``true``. The exporters read
``OTEL_EXPORTER_OTLP_ENDPOINT`` and the rest; the resource ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``;
the sampler ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG``; the propagators ``OTEL_PROPAGATORS``
(default W3C trace context and baggage); the batching ``OTEL_BSP_*``. Off (the default), nothing of
OpenTelemetry is imported and a call costs one ``is None`` test.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import grpc

from indexer_service.service.codec import SERVICE_NAME
from indexer_service.service.config import ConfigError
from indexer_service.service.observability.version import VERSION

log = logging.getLogger(__name__)

# The SDK's own names: the exporter entry points of each OTLP protocol.
_OTLP_BY_PROTOCOL = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}
_EXPORTER_GROUP = "opentelemetry_traces_exporter"


def exporter_names(env: Mapping[str, str] | None = None) -> list[str]:
    """The span exporters the environment asks for ([] when tracing is off), as the SDK's entry point names."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [name.strip() for name in env.get("OTEL_TRACES_EXPORTER", "").split(",") if name.strip()]
    if not names or names == ["none"]:
        return []
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    protocol = protocol.strip()
    if protocol not in _OTLP_BY_PROTOCOL:
        choices = ", ".join(_OTLP_BY_PROTOCOL)
        raise ConfigError("OTEL_EXPORTER_OTLP_PROTOCOL", f"must be one of {choices}, got {protocol!r}", "env")
    return [_OTLP_BY_PROTOCOL[protocol] if name == "otlp" else name for name in names if name != "none"]


def exporter_entry_points(env: Mapping[str, str] | None = None) -> list[EntryPoint]:
    """The installed span exporters the environment asks for ([] when tracing is off: nothing imported), or a
    ConfigError naming what is wrong. The command line checks this before it starts anything, so a mistake stops
    the start with exit 2 with one worker or several (a worker's failure would be the replica's exit 1)."""
    names = exporter_names(env)
    if not names:
        return []
    found = []
    for name in names:
        points = entry_points(group=_EXPORTER_GROUP, name=name)
        if not points:
            raise ConfigError("OTEL_TRACES_EXPORTER", f"no span exporter {name!r} is installed", "env")
        found.append(next(iter(points)))
    return found


class RpcTracer:
    """The tracer of one serving process: :meth:`start` a server span per call, :meth:`shutdown` to flush."""

    def __init__(self, exporters: list[EntryPoint]) -> None:
        from opentelemetry import propagate, trace
        from opentelemetry.sdk.resources import SERVICE_VERSION, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # TracerProvider reads the sampler from OTEL_TRACES_SAMPLER(_ARG); Resource.create the OTEL_SERVICE_NAME
        # and OTEL_RESOURCE_ATTRIBUTES (service.name is "unknown_service" without them).
        self.provider = TracerProvider(resource=Resource.create({SERVICE_VERSION: VERSION}))
        for exporter in exporters:
            self.provider.add_span_processor(BatchSpanProcessor(exporter.load()()))
        self.tracer = self.provider.get_tracer("indexer_service", VERSION)
        self._extract = propagate.extract
        self._server = trace.SpanKind.SERVER
        self._error = trace.StatusCode.ERROR
        self._status = trace.Status

    def start(self, transport: str, method: str, request_id: str, carrier: Mapping[str, str]) -> Any:
        """A started server span for one call of ``method``; ``carrier``: the call's metadata or headers."""
        return self.tracer.start_span(
            f"{SERVICE_NAME}/{method}",
            context=self._extract(carrier),
            kind=self._server,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": SERVICE_NAME,
                "rpc.method": method,
                "indexer.transport": transport,
                "indexer.request_id": request_id,
            },
        )

    def end(self, span: Any, code: str, details: str) -> None:
        """End ``span`` with the call's status code (a gRPC code's name); an error's details as its status."""
        span.set_attribute("rpc.grpc.status_code", grpc.StatusCode[code].value[0])
        span.set_attribute("indexer.code", code)
        if code != "OK":
            span.set_status(self._status(self._error, details))
        span.end()

    def shutdown(self) -> None:
        """Export what is batched (the process is about to end)."""
        self.provider.shutdown()


def start_tracing() -> RpcTracer | None:
    """The process's tracer when the environment turns tracing on, else None (nothing imported)."""
    exporters = exporter_entry_points()
    if not exporters:
        return None
    tracer = RpcTracer(exporters)
    log.info("tracing exporters=%s", ",".join(exporter.name for exporter in exporters))
    return tracer
