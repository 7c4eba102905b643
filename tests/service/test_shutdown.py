"""SIGTERM during a burst of calls against a real server process: NOT_SERVING and /readyz 503 at once, every
accepted call finishes (including one that runs for seconds), the process exits 0."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.protos.indexer.v1 import indexer_pb2_grpc as pb_grpc
from indexer_service.service.codec import SERVICE_NAME, chunk_inputs_to_proto, encode_int32
from testkit.batches import make_inputs
from testkit.h2raw import RawGrpcConnection
from testkit.harness import INDEXER_SERVICE, ServiceProcess, clean_env, http_get, listen_flags, poll
from testkit.payloads import grpc_frame
from tests.service.conftest import StartServer, scrape

pytestmark = pytest.mark.slow

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SHUTDOWN_DELAY = 2.0  # wide windows: calls sent in its first half must reach a loaded 2-core server in time
GRACE = 30.0
SMALL = pb.BuildChunkRequest(
    query_start_loc=encode_int32(np.arange(0, 4097, 64)),
    seq_lens=encode_int32(np.full(64, 4096)),
    compress_ratio=4,
    req_start=0,
    req_end=64,
)
# One request of 65,536 query rows cut into one chunk per row by a one-element logits budget: seconds of
# real work (each chunk is planned, built and encoded), not a sleep.
LONG_ROWS = 65_536
LONG = pb.PlanBatchRequest(
    query_start_loc=encode_int32(np.array([0, LONG_ROWS])),
    seq_lens=encode_int32(np.array([1_000_000])),
    compress_ratio=1,
    max_logits_bytes=4,
    omit_token_to_seq=True,
)


@dataclass
class Call:
    start: float
    end: float
    code: grpc.StatusCode


def burst(address: str, calls: list[Call], stop: threading.Event) -> None:
    """Small calls back to back on a channel of its own, no retries, until the server is gone."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.PrefillMetadataStub(channel)
        while not stop.is_set():
            start = time.monotonic()
            try:
                stub.BuildChunk(SMALL, timeout=GRACE)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
            calls.append(Call(start, time.monotonic(), code))
            if code is grpc.StatusCode.UNAVAILABLE:
                time.sleep(0.01)


def draining_server(start_server: StartServer, delay: float, *flags: str) -> ServiceProcess:
    """A numpy server with no warmup, ``flags``, and the drain's delay and GRACE."""
    return start_server(
        "--backend",
        "numpy",
        "--warmup-target",
        "none",
        *flags,
        "--shutdown-delay-seconds",
        str(delay),
        "--shutdown-grace-seconds",
        str(GRACE),
    )


@pytest.mark.exclusive  # calls sent in the delay's first half must reach the server in time
def test_sigterm_during_a_burst_drains_and_exits_0(start_server: StartServer) -> None:
    server = draining_server(
        start_server, SHUTDOWN_DELAY, "--max-num-batched-tokens", str(LONG_ROWS), "--max-plan-chunks", str(LONG_ROWS)
    )
    calls: list[Call] = []
    stop = threading.Event()
    workers = [threading.Thread(target=burst, args=(server.address, calls, stop)) for _ in range(4)]
    long_result: dict[str, object] = {}

    def long_call() -> None:
        # its answer (~5.5 MB) is above gRPC clients' 4 MiB default
        with grpc.insecure_channel(server.address, options=[("grpc.max_receive_message_length", 2**26)]) as channel:
            try:
                long_result["response"] = pb_grpc.PrefillMetadataStub(channel).PlanBatch(LONG, timeout=GRACE)
            except grpc.RpcError as exc:
                long_result["error"] = exc
            long_result["end"] = time.monotonic()

    long_thread = threading.Thread(target=long_call)
    try:
        for worker in workers:
            worker.start()
        long_thread.start()
        # Accepted, not just sent: the server counts it in flight.
        deadline = time.monotonic() + 30
        while scrape(server).value("indexer_requests_in_flight", method="PlanBatch") != 1:
            assert time.monotonic() < deadline and long_thread.is_alive(), server.log()
            time.sleep(0.02)

        sigterm_at = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        readyz, health = None, None
        with grpc.insecure_channel(server.address) as channel:
            checker = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < sigterm_at + SHUTDOWN_DELAY / 2 and (readyz, health) != (503, NOT_SERVING):
                readyz = http_get(f"{server.http_url}/readyz")[0]
                health = checker.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status
        assert (readyz, health) == (503, NOT_SERVING)

        exit_code = server.process.wait(GRACE + 10)
        exited_at = time.monotonic()
    finally:
        stop.set()
        for worker in [*workers, long_thread]:
            worker.join(GRACE + 10)

    assert exit_code == 0, server.log()
    assert "error" not in long_result, long_result
    assert len(long_result["response"].chunks) == LONG_ROWS
    assert long_result["end"] > sigterm_at + SHUTDOWN_DELAY, "the long call should have outlived the delay"
    assert long_result["end"] <= exited_at

    assert calls, "the burst made no call"
    # Calls sent before SIGTERM, and during most of the delay while the server says NOT_SERVING, were accepted
    # and must have succeeded. Once the server stops taking calls, new ones are refused: UNAVAILABLE, or
    # CANCELLED for a call gRPC had received but not yet handed to the application when it shut down.
    accepted = [c for c in calls if c.start < sigterm_at + SHUTDOWN_DELAY / 2]
    assert accepted and all(c.code is grpc.StatusCode.OK for c in accepted)
    refused = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
    assert {c.code for c in calls} <= {grpc.StatusCode.OK, *refused}, {c.code for c in calls}
    assert any(c.start > sigterm_at and c.code is grpc.StatusCode.OK for c in calls), "none served while draining"

    log = server.log()
    drained = re.search(r"stopped drain_seconds=([\d.]+)", log)
    assert "shutdown signal=SIGTERM" in log and "draining" in log and drained, log
    assert float(drained.group(1)) < GRACE


# A signal at any moment of the start-up: before the warmup (the configuration just read), early in a cold
# warmup (where the interpreter's teardown used to abort the process, exit -6, "terminate called after throwing
# an instance of ''": the warmup thread was inside Triton's C++ compiler), later in it, and once ready.
MOMENTS = [
    (signal.SIGTERM, "start pid=", 0.0),
    (signal.SIGINT, "start pid=", 0.0),
    (signal.SIGTERM, "warmup start", 0.0),
    (signal.SIGTERM, "warmup start", 0.3),
    (signal.SIGINT, "warmup start", 0.3),
    (signal.SIGTERM, "warmup start", 0.3),
    (signal.SIGTERM, "warmup start", 0.8),
    (signal.SIGINT, "warmup 1/3", 0.0),
    (signal.SIGTERM, "ready backend=", 0.2),
]


@pytest.mark.parametrize(
    ("signum", "marker", "delay"), MOMENTS, ids=[f"{s.name}-{m.rstrip('= ')}-{d}s" for s, m, d in MOMENTS]
)
def test_a_signal_at_any_moment_ends_the_process_with_0(
    signum: signal.Signals, marker: str, delay: float, tmp_path: Path
) -> None:
    """One moment of MOMENTS per case (one 53 s loop before): each case a server of its own with a cold Triton
    cache (the warmup compiles), so cases run in parallel under pytest-xdist."""
    log_path = tmp_path / "server.log"
    env = clean_env(TRITON_CACHE_DIR=str(tmp_path / "cold-cache"))
    command = [INDEXER_SERVICE, "serve", "--backend", "numpy", "--warmup-target", "cuda:90", *listen_flags()]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while marker not in log_path.read_text(errors="replace"):
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.01)
        time.sleep(delay)
        process.send_signal(signum)
        code = process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    text = log_path.read_text(errors="replace")
    assert code == 0, text
    assert "terminate called" not in text and "Traceback" not in text, text
    assert f"shutdown signal={signum.name}" in text, text


@pytest.mark.exclusive  # the stalled answer must still be unsent when SIGTERM's stop begins
def test_an_answer_still_being_sent_is_delivered_during_the_grace(start_server: StartServer) -> None:
    """A call whose handler has returned but whose answer gRPC is still sending (its reader granted no credit yet)
    is a call in flight: the drain's stop waits for it within the grace rather than cancelling every call once no
    handler runs, and the answer arrives whole with status OK once the reader reads."""
    medium = make_inputs("medium-64")  # its answer (346 KB) is many flow-control windows
    query_tokens = int(medium.query_start_loc[-1])
    server = draining_server(start_server, 0.0, "--max-num-batched-tokens", str(2 * query_tokens))
    request = chunk_inputs_to_proto(medium).SerializeToString()
    with grpc.insecure_channel(server.address) as channel:
        answer = channel.unary_unary(f"/{SERVICE_NAME}/BuildChunk")(request, timeout=10)
    raw = RawGrpcConnection(server.grpc_host, server.grpc_port, initial_window_size=0, read_past_goaway=True)
    try:
        assert raw.wait_settings()
        stream = raw.start_call(f"/{SERVICE_NAME}/BuildChunk", request)
        assert stream is not None
        answered = poll(
            lambda: (
                raw.streams[stream].headers_at is not None
                and not scrape(server).value("indexer_requests_in_flight", method="BuildChunk")
            ),
            10.0,
        )
        assert answered, server.log()
        server.process.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # twenty turns of the stop's loop: each found no handler running
        outcome = raw.streams[stream]
        assert not outcome.ended and server.process.poll() is None, (outcome, server.log())
        raw.grant(stream, 2 * len(answer))
        assert poll(lambda: outcome.ended, 10.0), (outcome, server.log())
        assert (outcome.grpc_status, outcome.reset_code) == (0, None), outcome
        assert outcome.data_bytes == len(grpc_frame(answer))
        assert server.process.wait(GRACE) == 0, server.log()
    finally:
        raw.close()


@pytest.mark.exclusive  # the reader's pace sets how long the answer takes to arrive
def test_a_slow_reader_that_keeps_sending_gets_its_whole_answer(start_server: StartServer) -> None:
    """SIGTERM while a call with a 5.5 MB answer runs, its client reading 16 KiB every 20 ms and sending a window
    update every 2 ms (as a gRPC client's updates come while it reads). After a GOAWAY, gRPC core closes a connection
    as soon as its last answer is in the kernel's send buffer, and the client's next frame then resets it, the
    rest of the answer lost (1.2 to 2.9 MB of it arrived, three runs of three). So the drain sends the GOAWAY only
    once the calls in flight have ended and every byte sent has reached its client: the whole answer arrives, with
    status OK, and the process exits 0."""
    server = draining_server(
        start_server, 0.0, "--max-num-batched-tokens", str(LONG_ROWS), "--max-plan-chunks", str(LONG_ROWS)
    )
    raw = RawGrpcConnection(server.grpc_host, server.grpc_port, read_past_goaway=True, read_pause=0.02)
    try:
        assert raw.wait_settings()
        stream = raw.start_call(f"/{SERVICE_NAME}/PlanBatch", LONG.SerializeToString())
        assert stream is not None
        raw.grant(stream, 2**30)  # credit for the whole answer: the pace is the reader's, not the window's
        raw.acknowledge_data = True
        raw.keep_sending(0.002)
        accepted = poll(lambda: scrape(server).value("indexer_requests_in_flight", method="PlanBatch") == 1, 30.0)
        assert accepted, server.log()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(GRACE + 10) == 0, server.log()
        outcome = raw.streams[stream]
        assert poll(lambda: outcome.ended, 10.0), (outcome, server.log())
        assert (outcome.grpc_status, outcome.reset_code) == (0, None), outcome
        assert outcome.data_bytes > 5_000_000, outcome
    finally:
        raw.close()
