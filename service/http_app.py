"""The HTTP transport, plain ASGI on uvicorn: probes, metrics, and the RPCs as binary protobuf over HTTP.

- ``GET /livez``: 200 while the process runs.
- ``GET /readyz``: 200 once warmup has finished, 503 with the reason before that and while draining.
- ``GET /metrics``: Prometheus exposition of the service's registry.
- ``POST /indexer.v1.PrefillMetadata/<Method>``: the gRPC method's request message as the body
  (``application/x-protobuf``), its response message back; errors as JSON ``{"code", "message"}`` with the
  HTTP status gRPC's HTTP mapping gives the code. Same data plane, limits, metrics as gRPC.
"""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
from prometheus_client import make_asgi_app

from service.codec import SERVICE_NAME
from service.dataplane import REQUEST_TYPES, DataPlane, ServiceError

log = logging.getLogger(__name__)

PROTOBUF = b"application/x-protobuf"
# google.rpc.Code to HTTP, as in google/api/http.proto's mapping.
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.INTERNAL: 500,
}


class HttpApp:
    """ASGI application over one data plane."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.metrics_app = make_asgi_app(registry=plane.metrics.registry)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path, verb = scope["path"], scope["method"]
        if path == "/metrics":
            await self.metrics_app(scope, receive, send)
        elif path == "/livez" and verb in ("GET", "HEAD"):
            await _reply(send, 200, b"ok\n")
        elif path == "/readyz" and verb in ("GET", "HEAD"):
            reason = self.plane.not_ready_reason()
            await _reply(send, 503 if reason else 200, f"{reason or 'ready'}\n".encode())
        elif path.startswith(f"/{SERVICE_NAME}/") and path.rsplit("/", 1)[1] in REQUEST_TYPES:
            if verb != "POST":
                await _reply(send, 405, b"POST a protobuf request message\n", [(b"allow", b"POST")])
            else:
                await self._rpc(path.rsplit("/", 1)[1], receive, send)
        else:
            await _reply(send, 404, b"not found\n")

    async def _rpc(self, method: str, receive, send) -> None:
        body = await _read_body(receive, self.plane.config.max_message_bytes)
        try:
            if body is None:
                raise ServiceError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"body: above max_message_bytes {self.plane.config.max_message_bytes}",
                )
            # The data plane is CPU-bound: keep the event loop free for probes and scrapes.
            response = await asyncio.get_running_loop().run_in_executor(None, self.plane.call, method, body, "body")
        except ServiceError as exc:
            log.info("http method=%s code=%s details=%r", method, exc.code.name, exc.message)
            payload = json.dumps({"code": exc.code.name, "message": exc.message}).encode()
            await _reply(send, _HTTP_STATUS.get(exc.code, 500), payload, content_type=b"application/json")
            return
        await _reply(send, 200, response, content_type=PROTOBUF)


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole request body, or None once it passes ``limit`` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _reply(
    send,
    status: int,
    body: bytes,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
    content_type: bytes = b"text/plain; charset=utf-8",
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(extra_headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
