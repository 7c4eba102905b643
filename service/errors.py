"""How a call fails, in the data plane's own words (KServe's ``errors.py``): one exception class per kind of
failure, none of them tied to a transport.

Each error has a :class:`Code`, the name of its outcome in google.rpc.Code's vocabulary: the name clients have
always seen (gRPC's status, the HTTP error body's ``"code"``) and the metrics' ``code`` label. Each transport
turns a code into its own status once: ``service/transport/grpc_calls.py`` into ``grpc.StatusCode``,
``service/transport/http_app.py`` into an HTTP status.
"""

from __future__ import annotations

import enum

from indexer_service.service.reasons import ShedReason


class Code(enum.Enum):
    """The outcomes a call can have (a subset of google.rpc.Code, same names)."""

    OK = "OK"
    CANCELLED = "CANCELLED"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"


class ServiceError(Exception):
    """A call's final failure: its :class:`Code`, a message for the caller, and ``shed_reason`` (why, a
    :class:`~indexer_service.service.reasons.ShedReason`) when the server refused or cut the call to protect
    itself."""

    code: Code = Code.INTERNAL

    def __init__(self, message: str, shed_reason: ShedReason | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.shed_reason = shed_reason


class InvalidArgument(ServiceError):
    """The request is malformed: a field's value means nothing (the message names the field)."""

    code = Code.INVALID_ARGUMENT


class LimitExceeded(ServiceError):
    """The request is well formed but asks for more than this server's limits allow."""

    code = Code.RESOURCE_EXHAUSTED


class OutOfMemory(LimitExceeded):
    """The backend ran out of host or GPU memory; the next request may fit."""


class Shed(LimitExceeded):
    """The server refused or cut the call to protect itself (busy, budget full, too much work)."""

    def __init__(self, reason: ShedReason, message: str) -> None:
        super().__init__(message, shed_reason=reason)


class PolicyRefused(ServiceError):
    """The request is valid and within limits, but this server's policy refuses it (a combination no engine
    supports, a kernel variant strict mode will not compile)."""

    code = Code.FAILED_PRECONDITION


class UnknownMethod(ServiceError):
    """The call names a method the service does not have."""

    code = Code.UNIMPLEMENTED


class NotReady(ServiceError):
    """The server cannot answer yet (warming up) or at all (its warmup failed). Not raised while draining: the
    data plane gates on the warmup, and gRPC itself refuses new calls once the server stops."""

    code = Code.UNAVAILABLE


class CallerGone(ServiceError):
    """The caller went away (``code`` CANCELLED, or DEADLINE_EXCEEDED); the work stopped."""

    def __init__(self, code: Code, message: str, shed_reason: ShedReason | None = None) -> None:
        super().__init__(message, shed_reason)
        self.code = code


class InternalError(ServiceError):
    """A fault of the server itself; the log has the traceback."""

    code = Code.INTERNAL
