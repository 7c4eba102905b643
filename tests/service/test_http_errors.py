"""Every HTTP error, on both HTTP ports, is JSON ``{"code", "message"}`` with its documented status (docs/service.md,
"HTTP"), those the connection protocol writes itself (431, 503) included; a JSON request of the wrong shape gets a
message naming the field and the form it takes, never a Python exception's text. Real servers on 127.0.0.1."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
from collections.abc import Iterator

import pytest
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor

from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.service.codec import SERVICE_NAME
from indexer_service.service.rpcs import REQUEST_TYPES
from indexer_service.service.transport.json_mapping import SUPPORTED_TYPES
from testkit.harness import FAST_START, ServiceProcess
from testkit.payloads import SMALL_BUILD_CHUNK, int32_bytes

BUILD_CHUNK = f"/{SERVICE_NAME}/BuildChunk"
PLAN_BATCH = f"/{SERVICE_NAME}/PlanBatch"
# What a Python exception's text looks like in a message; none may reach a caller.
PYTHON_TEXTS = ("Traceback", "can only concatenate", "invalid literal", "codec can't", "object is not", "has no len")


@pytest.fixture(scope="module")
def server() -> Iterator[ServiceProcess]:
    with ServiceProcess(*FAST_START, "--http-max-header-bytes", "1024") as process:
        yield process


def request(port: int, verb: str, path: str, body: bytes = b"", content_type: str | None = None) -> tuple:
    """(status, headers, body) of one request on a fresh connection."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        headers = {"content-type": content_type} if content_type else {}
        connection.request(verb, path, body=body or None, headers=headers)
        reply = connection.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        connection.close()


def assert_json_error(status: int, headers: dict, body: bytes, want_status: int, want_code: str, *fragments: str):
    assert status == want_status, body
    assert headers.get("content-type") == "application/json", headers
    error = json.loads(body)
    assert set(error) == {"code", "message"} and error["code"] == want_code, error
    for fragment in fragments:
        assert fragment in error["message"], error
    assert not any(text in error["message"] for text in PYTHON_TEXTS), error
    return error


# port, verb, path, body, content type, status, code, a fragment of the message, the Allow header (if any)
TRANSPORT_ERRORS = [
    ("metrics", "GET", "/nope", b"", None, 404, "NOT_FOUND", "serves only GET /metrics, /livez and /readyz", None),
    ("metrics", "POST", BUILD_CHUNK, b"", None, 404, "NOT_FOUND", "served on http_rpc_port", None),
    ("metrics", "POST", "/metrics", b"", None, 405, "UNIMPLEMENTED", "GET and HEAD only", "GET, HEAD"),
    ("metrics", "DELETE", "/readyz", b"", None, 405, "UNIMPLEMENTED", "GET and HEAD only", "GET, HEAD"),
    ("rpc", "GET", BUILD_CHUNK, b"", None, 405, "UNIMPLEMENTED", "takes POST", "POST"),
    ("rpc", "POST", f"/{SERVICE_NAME}/Nope", b"", None, 501, "UNIMPLEMENTED", "no method 'Nope'; its methods", None),
    ("rpc", "GET", f"/{SERVICE_NAME}/Nope", b"", None, 404, "NOT_FOUND", "no method 'Nope'; its methods are", None),
    ("rpc", "GET", "/metrics", b"", None, 404, "NOT_FOUND", "is served on http_port", None),
    ("rpc", "GET", "/", b"", None, 404, "NOT_FOUND", "this port serves POST", None),
    ("rpc", "POST", BUILD_CHUNK, b"x=1", "text/plain", 415, "INVALID_ARGUMENT", "send application/x-protobuf", None),
    ("rpc", "POST", BUILD_CHUNK, b"\xff\xff", "application/x-protobuf", 400, "INVALID_ARGUMENT", "body: ", None),
    ("rpc", "POST", BUILD_CHUNK, b"\0" * 200_000, None, 429, "RESOURCE_EXHAUSTED", "body: above", None),
    (
        "rpc",
        "POST",
        BUILD_CHUNK,
        b'{"reqEnd": 1}',
        "application/json",
        400,
        "INVALID_ARGUMENT",
        "query_start_loc",
        None,
    ),
]


@pytest.mark.parametrize(
    ("port", "verb", "path", "body", "content_type", "status", "code", "fragment", "allow"),
    TRANSPORT_ERRORS,
    ids=[f"{e[0]}-{e[1]}-{e[2].rsplit('/', 1)[-1] or 'root'}-{e[5]}" for e in TRANSPORT_ERRORS],
)
def test_every_http_error_is_json_with_its_status(
    server, port, verb, path, body, content_type, status, code, fragment, allow
) -> None:
    number = server.http_port if port == "metrics" else server.http_rpc_port
    got_status, headers, got_body = request(number, verb, path, body, content_type)
    assert_json_error(got_status, headers, got_body, status, code, fragment)
    assert headers.get("allow") == allow


def raw_exchange(port: int, data: bytes) -> bytes:
    """Everything the server sends back to ``data`` on one connection, until it closes."""
    received = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        # Refused before all of it was read: the answer is already on its way.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        try:
            while chunk := sock.recv(65536):
                received.append(chunk)
        except ConnectionResetError:
            pass
    return b"".join(received)


def parse_raw(reply: bytes) -> tuple[int, dict, bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body


@pytest.mark.parametrize("port", ["metrics", "rpc"])
def test_a_request_head_over_the_limit_is_a_json_431(server, port) -> None:
    number = server.http_port if port == "metrics" else server.http_rpc_port
    head = b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 4096 + b"\r\n\r\n"
    status, headers, body = parse_raw(raw_exchange(number, head))
    assert_json_error(status, headers, body, 431, "RESOURCE_EXHAUSTED", "request head and trailers above 1024 bytes")


@pytest.mark.parametrize("port", ["metrics", "rpc"])
def test_a_connection_over_the_limit_is_a_json_503_and_each_port_counts_its_own(port) -> None:
    """No per-peer cap here: on a port of one connection, its one peer is at its share of the crowded port, and a
    check between the two connects would have the kernel drop the second before accept (the share's own tests:
    tests/system/test_floods_gate.py)."""
    with ServiceProcess(*FAST_START, "--http-max-connections", "1", "--max-connections-per-peer", "0") as server:
        number, other = (
            (server.http_port, server.http_rpc_port) if port == "metrics" else (server.http_rpc_port, server.http_port)
        )
        with socket.create_connection(("127.0.0.1", number), timeout=10) as held:
            held.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
            assert held.recv(65536)  # answered: the server has taken this connection
            status, headers, body = parse_raw(raw_exchange(number, b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n"))
            assert_json_error(status, headers, body, 503, "UNAVAILABLE", "too many connections")
            # The other port's limit is its own: it still takes a connection.
            assert request(other, "GET", "/livez" if port == "rpc" else "/", b"")[0] in (200, 404)


# --- JSON requests of the wrong shape -------------------------------------------------------------------------

QSL = base64.b64encode(int32_bytes([0, 1, 4, 9])).decode()
SEQS = base64.b64encode(int32_bytes([20, 10, 5])).decode()

# id: (path, body, the message's start or a fragment of it)
WRONG_SHAPES = {
    "number-array-for-bytes": (
        BUILD_CHUNK,
        b'{"queryStartLoc": [0, 1, 4, 9]}',
        "bytes field `query_start_loc` must be a base64 string",
    ),
    "number-for-bytes": (BUILD_CHUNK, b'{"seqLens": 5}', "bytes field `seq_lens` must be a base64 string"),
    "bytes-outside-the-alphabet": (
        BUILD_CHUNK,
        b'{"queryStartLoc": "AAAA$$$$"}',
        "bytes field `query_start_loc` must be a base64 string (standard or URL-safe alphabet, = padding optional), "
        'got the string "AAAA$$$$"',
    ),
    "bytes-of-impossible-length": (BUILD_CHUNK, b'{"seqLens": "AAAAA"}', "bytes field `seq_lens` must be a base64"),
    "bytes-mixing-both-alphabets": (BUILD_CHUNK, b'{"seqLens": "AA+_"}', "bytes field `seq_lens` must be a base64"),
    "bytes-wrongly-padded": (BUILD_CHUNK, b'{"seqLens": "AAAA=="}', "bytes field `seq_lens` must be a base64"),
    "word-for-int32": (
        BUILD_CHUNK,
        b'{"compressRatio": "four"}',
        "int32 field `compress_ratio` must be an integer from -2147483648 to 2147483647",
    ),
    "fraction-for-int32": (BUILD_CHUNK, b'{"reqEnd": 1.5}', "int32 field `req_end` must be an integer"),
    "int32-out-of-range": (BUILD_CHUNK, b'{"reqEnd": 2147483648}', "int32 field `req_end` must be an integer"),
    "int64-out-of-range": (
        PLAN_BATCH,
        b'{"maxModelLen": "9223372036854775808"}',
        "int64 field `max_model_len` must be an integer from -9223372036854775808 to 9223372036854775807",
    ),
    "huge-exponent": (BUILD_CHUNK, b'{"reqEnd": 1e999999999}', "int32 field `req_end` must be an integer"),
    "bool-for-int32": (BUILD_CHUNK, b'{"reqEnd": true}', "int32 field `req_end` must be an integer"),
    "string-for-bool": (BUILD_CHUNK, b'{"skipKvGather": "yes"}', "bool field `skip_kv_gather` must be true or false"),
    "number-for-message": (
        BUILD_CHUNK,
        b'{"querySlice": 5}',
        "field `query_slice` must be a JSON object (a QuerySlice)",
    ),
    "wrong-field-inside-a-message": (
        BUILD_CHUNK,
        b'{"querySlice": {"start": "x"}}',
        "int32 field `query_slice.start` must be an integer",
    ),
    "unknown-field": (BUILD_CHUNK, b'{"queryStart": "AAAA"}', "unknown field `queryStart` in BuildChunkRequest"),
    "array-for-the-message": (BUILD_CHUNK, b"[1, 2]", "body must be a JSON object (a BuildChunkRequest)"),
    "not-json": (BUILD_CHUNK, b'{"reqEnd": 1,}', "body is not valid JSON: "),
    "nan": (BUILD_CHUNK, b'{"reqEnd": NaN}', "body is not valid JSON: NaN is not a JSON value"),
    "not-utf-8": (BUILD_CHUNK, b'{"reqEnd": "\xff"}', "body is not UTF-8 (byte 0xff at offset 12)"),
    "nested-too-deeply": (BUILD_CHUNK, b"[" * 50_000, "body is not valid JSON: nested too deeply"),
}


@pytest.mark.parametrize(("path", "body", "fragment"), WRONG_SHAPES.values(), ids=WRONG_SHAPES.keys())
def test_a_json_request_of_the_wrong_shape_names_the_field_and_its_form(server, path, body, fragment) -> None:
    status, headers, answer = request(server.http_rpc_port, "POST", path, body, "application/json")
    assert_json_error(status, headers, answer, 400, "INVALID_ARGUMENT", fragment)


def base64_forms(data: bytes) -> dict[str, str]:
    standard = base64.b64encode(data).decode()
    url_safe = base64.urlsafe_b64encode(data).decode()
    return {
        "standard-padded": standard,
        "standard-unpadded": standard.rstrip("="),
        "url-safe-padded": url_safe,
        "url-safe-unpadded": url_safe.rstrip("="),
    }


# seq_lens 1023 (ff 03 00 00) spells "/" in the standard alphabet and "_" in the URL-safe one; query_start_loc's
# 16 bytes end in "==" padding.
LONG_SEQS = [1023, 1023, 1023]


@pytest.mark.parametrize("form", list(base64_forms(b"")))
def test_bytes_fields_take_every_base64_form_protojson_accepts(server, form) -> None:
    """protobuf.dev's ProtoJSON table, bytes row: "Either standard or URL-safe base64 encoding with/without
    paddings are accepted" (grpcurl accepts only the first form: docs/clients.md)."""
    wanted = pb.BuildChunkRequest(
        query_start_loc=int32_bytes([0, 1, 4, 9]), seq_lens=int32_bytes(LONG_SEQS), compress_ratio=4, req_end=3
    )
    body = {
        "queryStartLoc": base64_forms(wanted.query_start_loc)[form],
        "seqLens": base64_forms(wanted.seq_lens)[form],
        "compressRatio": "4",  # a string holding a number: accepted for integers
        "req_end": 3.0,  # the proto name, and a number with a zero fraction
    }
    assert ("/" in body["seqLens"]) == form.startswith("standard") and body["queryStartLoc"].endswith("==") == (
        form.endswith("-padded")
    )
    status, _, json_answer = request(
        server.http_rpc_port, "POST", BUILD_CHUNK, json.dumps(body).encode(), "application/json"
    )
    assert status == 200, json_answer
    status, _, answer = request(server.http_rpc_port, "POST", BUILD_CHUNK, wanted.SerializeToString())
    assert status == 200
    assert json_format.Parse(json_answer, pb.BuildChunkResponse()) == pb.BuildChunkResponse.FromString(answer)


def test_every_request_field_has_a_checked_json_form() -> None:
    """service/transport/json_mapping.py checks the field types the requests use; a new field of another type must fail
    here, not a caller's request."""

    def fields(descriptor) -> Iterator[FieldDescriptor]:
        for field in descriptor.fields:
            yield field
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                yield from fields(field.message_type)

    for message_type in REQUEST_TYPES.values():
        for field in fields(message_type.DESCRIPTOR):
            assert field.type in SUPPORTED_TYPES and not field.is_repeated, f"{message_type.__name__}.{field.name}"


def test_json_printed_by_protobuf_is_read_back(server) -> None:
    """A JSON body built by protobuf's own printer is read back to the same message (a round trip)."""
    body = json_format.MessageToJson(SMALL_BUILD_CHUNK).encode()
    status, _, json_answer = request(server.http_rpc_port, "POST", BUILD_CHUNK, body, "application/json")
    assert status == 200 and json.loads(json_answer)["metadata"]["totalSeqLens"] == "3"
