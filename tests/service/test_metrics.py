"""A real scrape of /metrics over HTTP, parsed by prometheus_client's parser: every metric
service/observability/metrics.py defines is exported, with sane values and bounded labels, after real calls."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from indexer_service.client import IndexerClient
from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.kernels.planner import BatchInputs
from indexer_service.kernels.specialization import ModelConfig, warmup_keys
from indexer_service.service.compute.backends import FAST_PATH_BACKEND
from indexer_service.service.dataplane import MAX_MISSED_VARIANTS
from indexer_service.service.observability.metrics import UNKNOWN_METHOD, Metrics
from testkit.harness import ServiceProcess
from tests.service.conftest import Scrape, scrape

METHODS = {"BuildChunk", "PlanBatch", "GetWarmupStatus"}
KEY_LABELS = {k.label() for k in warmup_keys(ModelConfig((0, 0, *([4, 128] * 20), 4, 0)))}


# Families whose series are named by what happened (the kernel variant that missed the warmup set), so none exists
# before it does: tests/service/test_rpc.py's warmup-miss tests check them.
LABELLED_BY_WHAT_HAPPENED = {"indexer_warmup_misses"}


def defined_metrics() -> dict[str, str]:
    """Name -> type of every metric family service/observability/metrics.py registers."""
    return {family.name: family.type for family in Metrics().registry.collect()}


@pytest.fixture(scope="module")
def after_calls(live_server: ServiceProcess) -> tuple[Scrape, Scrape]:
    """Scrapes before and after: 3 good BuildChunk (8 query rows, 2 requests each), 1 good PlanBatch, 1 bad call."""
    before = scrape(live_server)
    qsl, seq = np.array([0, 1, 4, 9]), np.array([20, 10, 5])
    with IndexerClient(live_server.address) as client:
        for _ in range(3):
            client.build_chunk(ChunkInputs(qsl, seq, 4, 1, 3))
        client.plan_batch(BatchInputs(qsl, seq, 4, 1, 1 << 20))
        with pytest.raises(grpc.RpcError):
            client.build_chunk(ChunkInputs(qsl, np.array([20, 1, 5]), 4, 1, 3))
        client.warmup_status()
    return before, scrape(live_server)


def increase(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return (after.value(name, **labels) or 0.0) - (before.value(name, **labels) or 0.0)


def test_every_defined_metric_is_exported_with_its_type(after_calls: tuple[Scrape, Scrape]) -> None:
    _, after = after_calls
    for name, kind in defined_metrics().items():
        assert name in after.families, f"{name} missing from /metrics"
        assert after.families[name].type == kind
        if name not in LABELLED_BY_WHAT_HAPPENED:
            assert after.families[name].samples, f"{name} has no sample"


@pytest.fixture(scope="module")
def served_backend(live_server: ServiceProcess) -> str:
    with IndexerClient(live_server.address) as client:
        return client.warmup_status().backend


def test_request_metrics_count_the_calls(after_calls: tuple[Scrape, Scrape], served_backend: str) -> None:
    before, after = after_calls
    assert increase(before, after, "indexer_request_duration_seconds_count", method="BuildChunk", code="OK") == 3
    assert increase(before, after, "indexer_request_duration_seconds_count", method="PlanBatch", code="OK") == 1
    count_bad = increase(
        before, after, "indexer_request_duration_seconds_count", method="BuildChunk", code="INVALID_ARGUMENT"
    )
    assert count_bad == 1
    assert increase(before, after, "indexer_request_errors_total", method="BuildChunk", code="INVALID_ARGUMENT") == 1
    assert increase(before, after, "indexer_request_errors_total", method="BuildChunk", code="OK") == 0
    assert increase(before, after, "indexer_request_query_tokens_count", method="BuildChunk") == 3
    assert increase(before, after, "indexer_request_query_tokens_sum", method="BuildChunk") == 3 * 8
    assert increase(before, after, "indexer_request_batch_requests_sum", method="BuildChunk") == 3 * 2
    assert increase(before, after, "indexer_request_batch_requests_sum", method="PlanBatch") == 2  # prefills only
    # The live server runs the default config: numpy without a GPU, where valid BuildChunk calls take the
    # compiled fast path ("native"); the Triton kernel on a CUDA machine, which has no fast path.
    backend = served_backend
    chunk_backend = FAST_PATH_BACKEND if backend == "numpy" else backend
    assert (
        increase(before, after, "indexer_backend_duration_seconds_count", method="BuildChunk", backend=chunk_backend)
        == 3
    )
    if chunk_backend != backend:
        assert (
            increase(before, after, "indexer_backend_duration_seconds_count", method="BuildChunk", backend=backend) == 0
        )
    assert increase(before, after, "indexer_backend_duration_seconds_count", method="PlanBatch", backend=backend) == 1
    backend_seconds = increase(
        before, after, "indexer_backend_duration_seconds_sum", method="BuildChunk", backend=chunk_backend
    )
    request_seconds = increase(before, after, "indexer_request_duration_seconds_sum", method="BuildChunk", code="OK")
    assert 0 < backend_seconds < request_seconds < 1
    for method in METHODS:
        assert after.value("indexer_requests_in_flight", method=method) == 0


def test_warmup_and_readiness_metrics(after_calls: tuple[Scrape, Scrape]) -> None:
    before, after = after_calls
    states = {s.labels["state"]: s.value for s in after.samples("indexer_warmup_keys")}
    # Compiled now or loaded from Triton's cache (a state of its own), whichever this server's cache made it.
    assert set(states) == {"planned", "compiled", "cached", "failed"}
    assert states["planned"] == states["compiled"] + states["cached"] == 3 and states["failed"] == 0
    per_key = {s.labels["key"]: s.value for s in after.samples("indexer_warmup_key_compile_seconds")}
    assert set(per_key) == KEY_LABELS and all(0 < v < 60 for v in per_key.values())
    assert after.value("indexer_compile_duration_seconds_count", phase="warmup") == 3
    assert after.value("indexer_warmup_duration_seconds") > 0
    assert after.value("indexer_warmup_failures_total") == 0
    assert after.value("indexer_ready") == 1
    # This module's calls use warmed ratios only: they compile nothing. (Other tests on the same server may send
    # unwarmed ratios, which a non-strict Triton server compiles and counts.)
    assert increase(before, after, "indexer_compiles_after_ready_total") == 0


def test_histograms_are_cumulative_and_labels_bounded(after_calls: tuple[Scrape, Scrape]) -> None:
    _, after = after_calls
    variants = {sample.labels["variant"] for sample in after.samples("indexer_warmup_misses_total")}
    assert len(variants) <= MAX_MISSED_VARIANTS + 1  # and "other"
    codes = {code.name for code in grpc.StatusCode}
    for name, kind in defined_metrics().items():
        for sample in after.families[name].samples:
            labels = sample.labels
            assert labels.get("method", "BuildChunk") in {*METHODS, UNKNOWN_METHOD}  # unknown: calls to no method
            assert labels.get("code", "OK") in codes
            assert labels.get("key", next(iter(KEY_LABELS))) in KEY_LABELS
            assert labels.get("backend", "numpy") in {"numpy", "triton", "native"}
            assert sample.value >= 0
        if kind != "histogram":
            continue
        series: dict[tuple, list[tuple[float, float]]] = {}
        for sample in after.samples(f"{name}_bucket"):
            rest = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            series.setdefault(rest, []).append((float(sample.labels["le"]), sample.value))
        for rest, buckets in series.items():
            counts = [count for _, count in sorted(buckets)]
            assert counts == sorted(counts), f"{name}{rest} buckets are not cumulative"
            assert counts[-1] == after.value(f"{name}_count", **dict(rest))
