"""What an on-call reads (issue 18): log lines as text or JSON in UTC, every call's request id in its lines and
returned to the caller, failed calls logged rate-limited, calls to unknown methods counted and logged, the
version everywhere (``--version``, the start log, GetWarmupStatus, ``indexer_build_info``), ``process_*``
metrics, and unknown ``INDEXER_*`` variables warned about. Real server processes on 127.0.0.1, real gRPC and
HTTP clients; the formatters alone on log records."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.service.codec import SERVICE_NAME, chunk_inputs_to_proto
from indexer_service.service.config import load_config, unknown_environment
from indexer_service.service.observability.logs import (
    MAX_REQUEST_ID_CHARS,
    REQUEST_ID,
    FailedCallLog,
    JsonFormatter,
    LibraryLogLimit,
    RateLimitedLog,
    TextFormatter,
    message_fields,
    request_id_from,
)
from indexer_service.service.observability.version import build, version_line
from indexer_service.service.overload.limits import max_request_bytes
from testkit.harness import FAST_START, INDEXER_SERVICE, ServiceProcess, clean_env, wait_for
from testkit.paths import REPO
from tests.service.conftest import StartServer, scrape

VERSION = metadata.version("indexer-service")
UTC_ISO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
GENERATED_ID = re.compile(r"[0-9a-f]{12}-[0-9a-f]+")
BUILD_CHUNK = f"/{SERVICE_NAME}/BuildChunk"
GOOD_REQUEST = chunk_inputs_to_proto(ChunkInputs(np.array([0, 4, 10]), np.array([8, 20]), 4, 0, 2)).SerializeToString()


def record(message: str, *args: object, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    made = logging.LogRecord("indexer_service.test", logging.INFO, __file__, 1, message, args, exc_info)
    made.created = 1_796_400_000.25  # 2026-12-04T16:00:00.250Z
    return made


# --- formats ------------------------------------------------------------------------------------------------


def test_text_lines_are_utc_with_the_zone_the_request_id_and_the_worker() -> None:
    line = TextFormatter(worker=3).format(record("rpc method=%s code=%s", "BuildChunk", "OK"))
    assert line == "2026-12-04T16:00:00.250Z INFO indexer_service.test rpc method=BuildChunk code=OK worker=3"
    token = REQUEST_ID.set("req-1")
    try:
        line = TextFormatter().format(record("x a=1", exc=True))
    finally:
        REQUEST_ID.reset(token)
    first, *traceback = line.splitlines()
    assert first == "2026-12-04T16:00:00.250Z INFO indexer_service.test x a=1 request_id=req-1"
    assert traceback[0].startswith("Traceback") and traceback[-1] == "ValueError: boom"


def test_json_lines_carry_the_event_and_every_field_as_keys() -> None:
    message = "rpc method=%s code=%s count=%d ms=%.3f peer=%s details=%s last=%r"
    args = ("BuildChunk", "INVALID_ARGUMENT", 7, 0.5, "ipv4:127.0.0.1:5", json.dumps('say "hi" a=b'), "it's")
    token = REQUEST_ID.set("req-2")
    try:
        line = JsonFormatter(worker=1).format(record(message, *args, exc=True))
    finally:
        REQUEST_ID.reset(token)
    parsed = json.loads(line)
    assert "\n" not in line
    assert parsed["ts"] == "2026-12-04T16:00:00.250Z" and parsed["level"] == "INFO"
    assert parsed["logger"] == "indexer_service.test" and parsed["event"] == "rpc"
    assert parsed["msg"] == message % args
    assert parsed["method"] == "BuildChunk" and parsed["code"] == "INVALID_ARGUMENT"
    assert parsed["count"] == 7 and parsed["ms"] == 0.5 and parsed["peer"] == "ipv4:127.0.0.1:5"
    assert parsed["details"] == 'say "hi" a=b' and parsed["last"] == "it's"
    assert parsed["request_id"] == "req-2" and parsed["worker"] == 1
    assert parsed["exc"].endswith("ValueError: boom")


def test_message_fields_keep_the_line_s_own_keys_and_odd_text() -> None:
    assert message_fields("warmup done keys=3") == ("warmup done", {"keys": 3})
    assert message_fields("no fields here") == ("no fields here", {})
    event, fields = message_fields("x level=DEBUG ts=1 msg=hi version=1.2.3 empty= bad='unclosed")
    assert event == "x" and fields == {"version": "1.2.3", "empty": "", "bad": "'unclosed"}
    # The supervisor's line about a worker keeps that worker's slot; a worker's own lines carry its own.
    about = record("worker exited worker=%d pid=%d", 1, 42)
    assert json.loads(JsonFormatter().format(about))["worker"] == 1
    assert json.loads(JsonFormatter(worker=0).format(about))["worker"] == 0


def test_request_ids_from_callers_are_kept_only_when_safe() -> None:
    for kept in ("abc", "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", "svc-1/req:42@x=y+z", "x" * MAX_REQUEST_ID_CHARS):
        assert request_id_from(kept) == kept
    for replaced in (None, "", "x" * (MAX_REQUEST_ID_CHARS + 1), "a b", 'a"b', "a\nb", "é", "a}{"):
        assert GENERATED_ID.fullmatch(request_id_from(replaced)), replaced
    assert request_id_from(None) != request_id_from(None)


def test_the_rate_limited_log_writes_one_line_per_key_and_interval_with_the_count(caplog) -> None:
    limited = RateLimitedLog(logging.getLogger("indexer_service.test"), interval=3600.0)
    written: list[tuple[str, int]] = []
    for _ in range(4):
        limited.write("a", lambda count: written.append(("a", count)))
    limited.write("b", lambda count: written.append(("b", count)))
    assert written == [("a", 1), ("b", 1)]
    assert limited.flush() == 0  # the held line of "a" is not due yet
    limited._last["a"] -= 3600.0  # the interval has passed
    limited.write("a", lambda count: written.append(("a", count)))
    assert written[-1] == ("a", 4)  # three held back and this one
    with caplog.at_level(logging.WARNING, logger="indexer_service.test"):
        for n in range(3):
            limited.note("http refused", "body_too_large", f"call {n}", "port=8081")
    assert [r.getMessage() for r in caplog.records] == [
        "http refused reason=body_too_large count=1 port=8081 last='call 0'"
    ]


def test_no_held_line_stays_unwritten_past_its_interval(caplog) -> None:
    # Five failures in a burst, then nothing: the four held back are written, with their count and the last one's
    # request id, once the interval has passed, by the timer (a line's last event is never lost).
    failed = FailedCallLog(interval=0.5)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(TextFormatter().format(record))  # formatted as written, as a handler
    logger = logging.getLogger("indexer_service.service.observability.logs")
    logger.addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger="indexer_service.service.observability.logs"):
            for n in range(5):
                token = REQUEST_ID.set(f"req-{n}")
                failed.record("rpc", "BuildChunk", "INVALID_ARGUMENT", f"bad {n}", "peer", 1.0)
                REQUEST_ID.reset(token)
            wait_for(lambda: len(lines) == 2, 5, "the held line, written by the timer")
    finally:
        logger.removeHandler(handler)
    first, held = lines
    assert "count=1" in first and 'details="bad 0"' in first and first.endswith("request_id=req-0")
    assert "count=4" in held and 'details="bad 4"' in held and held.endswith("request_id=req-4")


def test_a_held_line_is_written_when_due_so_no_event_waits_longer_than_the_interval() -> None:
    # Issue 37: no failure unwritten for more than the interval (10 s in the service). A held event came after its
    # key's last line, so a line written when due (the last line + the interval) is within the interval of it; the
    # timer once looked every second, so a held line could wait up to a second past that.
    limited = RateLimitedLog(logging.getLogger("indexer_service.test"), interval=1.5)
    written: list[float] = []
    limited.write("a", lambda count: written.append(time.monotonic()))
    first = written[0]
    assert limited.next_due() is None  # nothing held
    time.sleep(0.3)  # the held event 0.3 s after the line: 0.3 s of slack for the timer's wake-up
    held_at = time.monotonic()
    limited.write("a", lambda count: written.append(time.monotonic()))
    assert limited.next_due() == limited._last["a"] + 1.5
    wait_for(lambda: len(written) == 2, 5, "the held line, written by the timer")
    assert written[1] >= first + 1.5 - 0.01, written  # not before it was due
    assert written[1] - held_at <= 1.5, (written, held_at)  # within the interval of the held event
    assert limited.next_due() is None


def test_failed_calls_are_rate_limited_per_method_and_code_but_internal_never(caplog) -> None:
    failed = FailedCallLog(interval=3600.0)
    with caplog.at_level(logging.INFO, logger="indexer_service.service.observability.logs"):
        for n in range(5):
            failed.record("rpc", "BuildChunk", "INVALID_ARGUMENT", f"bad {n}", "peer", 1.0)
            failed.record("rpc", "PlanBatch", "INVALID_ARGUMENT", f"bad {n}", "peer", 1.0)
            failed.record("rpc", "BuildChunk", "INTERNAL", f"broken {n}", "peer", 1.0)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert sum("code=INVALID_ARGUMENT" in m for _, m in lines) == 2  # one per method
    assert [level for level, m in lines if "code=INTERNAL" in m] == ["ERROR"] * 5


def test_unknown_indexer_variables_are_named_with_the_closest_setting() -> None:
    env = {"INDEXER_GRPC_PROT": "1", "INDEXER_LOG_LEVEL": "DEBUG", "INDEXER_CONFIG": "x", "INDEXER_ZZZ": "1"}
    # The image's build variables are known too: the image sets them, and no start may warn about its own.
    env |= {"INDEXER_BUILD_COMMIT": "abc", "INDEXER_IMAGE_REVISION": "abc"}
    assert unknown_environment(env) == {"INDEXER_GRPC_PROT": "INDEXER_GRPC_PORT", "INDEXER_ZZZ": None}


def test_the_cli_warns_about_unknown_variables_and_goes_on() -> None:
    env = clean_env(INDEXER_MAX_NUM_SEQ="3", INDEXER_WARMUP_TARGET="none")
    done = subprocess.run([INDEXER_SERVICE, "keys"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.count("\n") == 3, done.stderr
    warning = [line for line in done.stderr.splitlines() if "INDEXER_MAX_NUM_SEQ" in line]
    assert len(warning) == 1 and re.match(rf"{UTC_ISO} WARNING ", warning[0]), done.stderr
    assert "did you mean INDEXER_MAX_NUM_SEQS?" in warning[0]


def test_version_flags_print_the_package_version_and_the_commit() -> None:
    for argv in (["--version"], ["serve", "--version"]):
        done = subprocess.run([INDEXER_SERVICE, *argv], capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout) == (0, f"indexer-service {version_line()}\n"), done.stderr
    # from this checkout: its HEAD; in an image, what the build set (and the image's revision)
    assert build()["commit"].startswith(git_head()[:12])
    env = clean_env(INDEXER_BUILD_COMMIT="0123456789ab", INDEXER_IMAGE_REVISION="deadbeef")
    done = subprocess.run([INDEXER_SERVICE, "--version"], capture_output=True, text=True, timeout=60, env=env)
    assert done.stdout == f"indexer-service {VERSION} (commit 0123456789ab, image deadbeef)\n", done.stderr


def git_head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=REPO).stdout


# --- a real server ------------------------------------------------------------------------------------------


def json_lines(server: ServiceProcess) -> list[dict]:
    """The server's JSON log lines (gRPC's C core writes its own few lines to stderr as they are)."""
    return [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]


def logged(server: ServiceProcess, keep: Callable[[list[dict]], bool], what: str) -> list[dict]:
    """The server's JSON lines once ``keep`` accepts them: the HTTP transport logs a failed call after its answer
    has gone out, so the caller can look before the line is written."""
    return wait_for(lambda: (lines := json_lines(server)) and keep(lines) and lines, 10, what)


def grpc_call(server: ServiceProcess, method: str, request: bytes, request_id: str | None = None):
    """(code, details, trailing metadata as a dict) of one unary call."""
    metadata = (("x-request-id", request_id),) if request_id is not None else None
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(method)
        try:
            _, answer = call.with_call(request, metadata=metadata, timeout=10)
            return grpc.StatusCode.OK, "", dict(answer.trailing_metadata())
        except grpc.RpcError as exc:
            return exc.code(), exc.details(), dict(exc.trailing_metadata() or ())


def http_post(server: ServiceProcess, path: str, body: bytes, headers: dict[str, str] | None = None):
    """(status, headers, body) of one POST, binary protobuf unless ``headers`` say otherwise."""
    headers = {"content-type": "application/x-protobuf", **(headers or {})}
    request = urllib.request.Request(f"{server.http_rpc_url}{path}", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


@pytest.fixture(scope="module")
def json_server(tmp_path_factory: pytest.TempPathFactory):
    server = ServiceProcess(*FAST_START, "--log-format", "json", workdir=tmp_path_factory.mktemp("json-server"))
    try:
        server.start().wait_listening()
        server.wait_ready(timeout=120.0, poll=0.05)
        yield server
    finally:
        server.kill()


def test_every_line_of_a_json_server_is_an_object_and_the_first_names_the_version(json_server) -> None:
    lines = [line for line in json_server.log().splitlines() if line.strip()]
    start, config = json.loads(lines[0]), json.loads(lines[1])
    assert start["event"] == "start" and f" indexer-service {VERSION} commit={build()['commit']} " in start["msg"]
    assert re.fullmatch(UTC_ISO, start["ts"]) and start["backend"] == "numpy"
    assert config["event"] == "config" and config["log_format"] == "json" and config["config_file"] == "none"
    assert "log_format: flag --log-format" in config["sources"], config["sources"]
    assert all(line.startswith("{") for line in lines if not re.match(r"[EWI]\d{4} ", line)), lines


def test_grpc_calls_return_their_request_id_and_failures_log_it(json_server) -> None:
    code, _, trailers = grpc_call(json_server, BUILD_CHUNK, GOOD_REQUEST, "caller-7")  # the C fast path
    assert code is grpc.StatusCode.OK and trailers["x-request-id"] == "caller-7"
    code, _, trailers = grpc_call(json_server, BUILD_CHUNK, GOOD_REQUEST)
    assert code is grpc.StatusCode.OK and GENERATED_ID.fullmatch(trailers["x-request-id"])
    code, _, trailers = grpc_call(json_server, BUILD_CHUNK, GOOD_REQUEST, "no spaces allowed")
    assert GENERATED_ID.fullmatch(trailers["x-request-id"])

    code, details, trailers = grpc_call(json_server, f"/{SERVICE_NAME}/PlanBatch", b"\xff\xff", "bad-plan-1")
    assert code is grpc.StatusCode.INVALID_ARGUMENT and trailers["x-request-id"] == "bad-plan-1"
    [line] = [line for line in json_lines(json_server) if line.get("request_id") == "bad-plan-1"]
    assert line["event"] == "rpc" and line["method"] == "PlanBatch" and line["code"] == "INVALID_ARGUMENT"
    assert line["count"] == 1 and line["details"] == details and line["level"] == "INFO"


def test_http_calls_return_their_request_id_and_failures_log_it(json_server) -> None:
    path = f"/{SERVICE_NAME}/BuildChunk"
    status, headers, _ = http_post(json_server, path, GOOD_REQUEST, {"x-request-id": "http-ok-1"})
    assert status == 200 and headers["x-request-id"] == "http-ok-1"
    status, headers, _ = http_post(json_server, path, GOOD_REQUEST, {"x-request-id": "x" * 200})
    assert status == 200 and GENERATED_ID.fullmatch(headers["x-request-id"])

    headers = {"x-request-id": "http-bad-1", "content-type": "application/json"}
    status, answer_headers, body = http_post(json_server, path, b"{not json", headers)
    assert status == 400 and answer_headers["x-request-id"] == "http-bad-1"
    lines = logged(
        json_server, lambda lines: any(line.get("request_id") == "http-bad-1" for line in lines), "http-bad-1"
    )
    [line] = [line for line in lines if line.get("request_id") == "http-bad-1"]
    assert line["event"] == "http" and line["code"] == "INVALID_ARGUMENT" and line["details"] in body.decode()

    status, answer_headers, _ = http_post(json_server, path, GOOD_REQUEST, {**headers, "content-type": "text/plain"})
    assert status == 415 and answer_headers["x-request-id"] == "http-bad-1"
    # A refusal before the data plane (a body above any valid request) carries it too.
    too_large = b"\0" * (max_request_bytes(load_config(env={})) + 1)
    status, answer_headers, _ = http_post(json_server, path, too_large, {"x-request-id": "http-big-1"})
    assert status == 429 and answer_headers["x-request-id"] == "http-big-1"


def test_failed_calls_are_logged_once_per_interval_with_their_count(start_server: StartServer) -> None:
    server = start_server(*FAST_START)
    method = f"/{SERVICE_NAME}/GetWarmupStatus"
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(method)
        for n in range(40):
            with pytest.raises(grpc.RpcError) as failed:
                call(b"\xff\xff", metadata=(("x-request-id", f"flood-{n}"),), timeout=10)
            assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    for _ in range(40):
        assert http_post(server, f"/{SERVICE_NAME}/GetWarmupStatus", b"\xff\xff")[0] == 400
    # 80 failures within the 10 s interval: one line per transport, the first call's (the count is 1).
    line = re.compile(r"^.* (rpc|http) method=GetWarmupStatus code=INVALID_ARGUMENT count=(\d+) .*$", re.M)
    wait_for(lambda: len(line.findall(server.log())) >= 2, 10, "the http line")
    lines = line.findall(server.log())
    assert sorted(lines) == [("http", "1"), ("rpc", "1")], server.log()
    assert "request_id=flood-0" in server.log() and "request_id=flood-1 " not in server.log()
    after = scrape(server)
    assert after.value("indexer_request_errors_total", method="GetWarmupStatus", code="INVALID_ARGUMENT") == 80


def test_unknown_methods_are_counted_and_logged_and_health_and_reflection_still_answer(json_server) -> None:
    before = scrape(json_server).value("indexer_request_errors_total", method="unknown", code="UNIMPLEMENTED")
    assert before is not None  # pre-created
    with grpc.insecure_channel(json_server.address) as channel:
        for name in ("/no.Such/Method", f"/{SERVICE_NAME}/Missing"):
            with pytest.raises(grpc.RpcError) as refused:
                channel.unary_unary(name)(b"", timeout=10)
            assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED and name in refused.value.details()
        streaming = channel.stream_stream("/no.Such/Stream")(iter([b"a", b"b"]), timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            list(streaming)
        assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        services = {s.name for s in next(reflection).list_services_response.service}
        assert SERVICE_NAME in services
    status, headers, body = http_post(json_server, "/no.Such/Method", b"x", {"x-request-id": "http-unknown-1"})
    assert status == 501 and headers["x-request-id"] == "http-unknown-1"
    assert json.loads(body)["code"] == "UNIMPLEMENTED"

    after = scrape(json_server).value("indexer_request_errors_total", method="unknown", code="UNIMPLEMENTED")
    assert after - before == 4

    def unimplemented(lines: list[dict]) -> list[dict]:
        return [line for line in lines if line.get("code") == "UNIMPLEMENTED"]

    lines = logged(json_server, lambda lines: len({x["event"] for x in unimplemented(lines)}) == 2, "both lines")
    assert {line["event"] for line in unimplemented(lines)} == {"rpc", "http"}
    assert any("/no.Such/Method" in line["details"] for line in unimplemented(lines))


def test_the_version_is_served_and_the_build_info_and_process_metrics_exported(json_server) -> None:
    with grpc.insecure_channel(json_server.address) as channel:
        answer = channel.unary_unary(f"/{SERVICE_NAME}/GetWarmupStatus")(b"", timeout=10)
    assert pb.GetWarmupStatusResponse.FromString(answer).server_version == version_line()
    check = subprocess.run([INDEXER_SERVICE, "check", json_server.address], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and f" server_version={version_line()}\n" in check.stdout, check.stdout
    metrics = scrape(json_server)
    [info] = metrics.samples("indexer_build_info")
    assert info.value == 1 and info.labels["version"] == VERSION and info.labels["commit"] == build()["commit"]
    assert info.labels["grpcio"] == grpc.__version__ and info.labels["numpy"] == np.__version__
    labels = {"version", "commit", "image_revision", "python", "grpcio", "protobuf", "numpy", "torch", "triton"}
    assert set(info.labels) == labels
    assert metrics.value("process_cpu_seconds_total") > 0
    assert metrics.value("process_resident_memory_bytes") > 0


@pytest.mark.slow
def test_workers_log_json_with_their_slot_and_export_process_metrics_per_process(start_server: StartServer) -> None:
    server = start_server(*FAST_START, "--workers", "2", "--log-format", "json", env=clean_env(INDEXER_WORKERS="2"))
    for _ in range(8):
        code, _, trailers = grpc_call(server, BUILD_CHUNK, b"\xff", "worker-bad-1")
        assert code is grpc.StatusCode.INVALID_ARGUMENT and trailers["x-request-id"] == "worker-bad-1"
    lines = json_lines(server)
    assert {line.get("worker") for line in lines} >= {0, 1, None}  # None: the supervisor's own lines
    assert all(re.fullmatch(UTC_ISO, line["ts"]) for line in lines)
    starts = [line["msg"] for line in lines if line["event"] == "start"]
    assert len(starts) == 3 and all(f" indexer-service {VERSION}" in msg for msg in starts), starts
    failed = [line for line in lines if line.get("request_id") == "worker-bad-1"]
    assert failed and all(line["worker"] in (0, 1) for line in failed)

    metrics = scrape(server)
    [info] = metrics.samples("indexer_build_info")  # once for the replica, not per worker
    assert info.labels["version"] == VERSION
    cpu = metrics.samples("process_cpu_seconds_total")
    processes = sorted((sample.labels["process"], sample.labels.get("worker")) for sample in cpu)
    assert processes == [("supervisor", None), ("worker", "0"), ("worker", "1")], cpu
    # Each series is its process's own: the start times are the supervisor's and its two children's.
    started = sorted(s.value for s in metrics.samples("process_start_time_seconds"))
    supervisor = psutil.Process(server.pid)
    created = sorted(p.create_time() for p in (supervisor, *supervisor.children()))
    assert len(created) == 3 and all(abs(a - b) < 0.1 for a, b in zip(started, created, strict=True)), started


def json_of(logger: str, message: str, *args: object) -> dict:
    record = logging.LogRecord(logger, logging.INFO, __file__, 1, message, args, None)
    return json.loads(JsonFormatter().format(record))


def test_every_json_line_has_a_stable_event_and_other_libraries_keep_their_text() -> None:
    assert json_of("indexer_service.service.process.supervisor", "worker exited worker=%d code=%d", 1, 0)["event"] == (
        "worker_exited"
    )
    own = json_of("indexer_service.service.compute.backends", "serving without the compiled fast path (x=1 here)")
    assert own["event"] == "message" and own["msg"].startswith("serving without")
    library = json_of("uvicorn.error", "Started server process [%d] key=value", 7144)
    assert library["event"] == "uvicorn_log" and library["msg"] == "Started server process [7144] key=value"
    assert "key" not in library  # another library's text is never split into keys
    assert json_of("opentelemetry.exporter.otlp", "Failed to export spans to %s", "x")["event"] == "opentelemetry_log"


def test_another_librarys_repeated_lines_are_written_once_per_interval_with_the_count() -> None:
    limit = LibraryLogLimit(interval=3600.0)

    def record(logger: str, message: str) -> logging.LogRecord:
        return logging.LogRecord(logger, logging.ERROR, __file__, 1, message, (), None)

    exporter = [record("opentelemetry.exporter", "Failed to export batch code: %s") for _ in range(5)]
    assert [limit.filter(r) for r in exporter] == [True, False, False, False, False]
    assert limit.filter(record("opentelemetry.exporter", "another text"))  # another template: its own line
    assert all(limit.filter(record("indexer_service.x", "shed")) for _ in range(3))  # the service's own pass
    limit._last[("opentelemetry.exporter", "Failed to export batch code: %s")] -= 3600.0
    again = record("opentelemetry.exporter", "Failed to export batch code: %s")
    assert limit.filter(again) and again.getMessage().endswith("[4 more like it]")


@pytest.mark.parametrize("how", ["flag", "env", "file"])
def test_a_configuration_error_at_start_is_a_json_line_under_json_logs(tmp_path: Path, how: str) -> None:
    flags, env = ["--grpc-port", "-5"], clean_env()
    if how == "flag":
        flags += ["--log-format", "json"]
    elif how == "env":
        env["INDEXER_LOG_FORMAT"] = "json"
    else:
        (tmp_path / "c.toml").write_text('log_format = "json"\n')
        flags += ["--config", str(tmp_path / "c.toml")]
    done = subprocess.run([INDEXER_SERVICE, "serve", *flags], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    error = json.loads(line)
    assert (error["level"], error["event"], error["setting"], error["source"]) == (
        "ERROR",
        "config_error",
        "grpc_port",
        "flag --grpc-port",
    )
    assert error["msg"].startswith("indexer-service serve: invalid config: grpc_port (from flag --grpc-port)")
