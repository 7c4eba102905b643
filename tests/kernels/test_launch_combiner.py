"""kernels.launch_combiner.LaunchCombiner: concurrent calls share launches, and each gets exactly its own outputs.

The launches are the real kernel through Triton's interpreter on CPU; a gate holds the first launch until the
other calls are queued behind it, so which calls share a launch is known, not left to thread timing."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from indexer_service.kernels.inputs import chunk_host_part
from indexer_service.kernels.launch_combiner import LaunchCombiner
from indexer_service.kernels.numpy_backend import chunk_arrays_numpy_many
from indexer_service.kernels.triton_launcher import TritonChunkBuilder
from testkit.batches import BatchShape, random_chunk_inputs

SHAPE = BatchShape(num_requests=6, max_query=40, max_context=300)


class GatedLaunch:
    """The builder's launch, with the first one held until ``queued`` calls wait behind it; records each
    launch's output size."""

    def __init__(self, launch, combiner_of: TritonChunkBuilder, queued: int) -> None:
        self.launch, self.builder, self.queued = launch, combiner_of, queued
        self.sizes: list[tuple[int, int]] = []
        self.fail_next = False

    def __call__(self, table, tokens, rows, dcp, ratio):
        if not self.sizes:
            deadline = time.monotonic() + 30
            while len(self.builder.combiner._queue) < self.queued and time.monotonic() < deadline:
                time.sleep(0.005)
        self.sizes.append((tokens, rows))
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("launch failed")
        return self.launch(table, tokens, rows, dcp, ratio)


def gated_builder(triton_cpu: TritonChunkBuilder, queued: int, max_elements: int = 1 << 24):
    builder = TritonChunkBuilder("cpu", kernel=triton_cpu.kernel)
    gate = GatedLaunch(builder._launch, builder, queued)
    builder.combiner = LaunchCombiner(gate, max_elements)
    return builder, gate


def in_threads(builder: TritonChunkBuilder, calls: list) -> list:
    """Each (hosts, dcp) call on its own thread, the first started alone so that it launches first."""
    results: list = [None] * len(calls)

    def one(n: int) -> None:
        try:
            results[n] = builder.arrays_many(*calls[n])
        except Exception as exc:
            results[n] = exc

    threads = [threading.Thread(target=one, args=(n,)) for n in range(len(calls))]
    threads[0].start()
    while not builder.combiner._leading:
        time.sleep(0.001)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a call never returned: the combiner stalled"
    return results


def random_calls(seed: int, ratios: list[int]) -> list:
    rng = np.random.default_rng(seed)
    calls = []
    for n, ratio in enumerate(ratios):
        chunks = [random_chunk_inputs(rng, SHAPE, ratio) for _ in range(1 + n % 3)]
        hosts = [h for h in (chunk_host_part(c) for c in chunks) if h is not None]
        calls.append((hosts, chunks[0].dcp))
    return calls


def assert_each_equals_numpy(calls: list, results: list) -> None:
    """Each call ``(hosts, dcp[, with_token_to_seq])``'s arrays are numpy's."""
    for call, got in zip(calls, results, strict=True):
        expected = chunk_arrays_numpy_many(*call)
        assert len(got) == len(expected)
        for got_chunk, expected_chunk in zip(got, expected, strict=True):
            for g, e in zip(got_chunk, expected_chunk, strict=True):
                np.testing.assert_array_equal(g, e)


def test_queued_calls_of_one_group_share_a_launch_and_each_gets_its_own_outputs(triton_cpu) -> None:
    """Six calls, two compress ratios: the first launches alone while the others queue; then one launch per
    ratio. Every call's arrays equal numpy's."""
    calls = random_calls(1, [4, 4, 128, 4, 128, 4])
    builder, gate = gated_builder(triton_cpu, queued=5)
    results = in_threads(builder, calls)
    assert_each_equals_numpy(calls, results)
    assert builder.combiner.launches == 3 and len(gate.sizes) == 3
    assert not builder.combiner._leading and builder.combiner._queue == []


def output_elements(hosts) -> int:
    return sum(int(h.cu_seq_lens[-1]) + 2 * (h.query_slice[1] - h.query_slice[0]) for h in hosts)


def test_calls_without_token_to_seq_share_a_launch_with_calls_that_have_it(triton_cpu) -> None:
    """Omitting token_to_seq empties a call's token ranges; combined with calls that keep theirs, every call
    still gets exactly its own arrays (an empty token_to_seq where omitted)."""
    with_tokens = random_calls(6, [4, 4, 4, 4])
    calls = [(*call, n % 2 == 0) for n, call in enumerate(with_tokens)]
    builder, _ = gated_builder(triton_cpu, queued=3)
    results = in_threads(builder, calls)
    assert_each_equals_numpy(calls, results)
    assert builder.combiner.launches == 2
    assert all(chunk[0].size == 0 for call, got in zip(calls, results, strict=True) if not call[2] for chunk in got)


def test_calls_that_together_pass_max_elements_launch_apart(triton_cpu) -> None:
    """max_elements is the smallest queued call's outputs: no two fit together, and each (even one above it)
    still launches."""
    calls = random_calls(2, [4, 4, 4, 4])
    smallest = min(output_elements(hosts) for hosts, _ in calls[1:])
    builder, _ = gated_builder(triton_cpu, queued=3, max_elements=smallest)
    results = in_threads(builder, calls)
    assert_each_equals_numpy(calls, results)
    assert builder.combiner.launches == 4


def test_a_failed_launch_fails_every_call_it_carried_and_the_next_calls_are_served(triton_cpu) -> None:
    calls = random_calls(3, [4, 4, 4])
    builder, gate = gated_builder(triton_cpu, queued=2)
    gate.fail_next = True  # the first launch (the first call alone)
    results = in_threads(builder, calls)
    assert isinstance(results[0], RuntimeError)
    assert_each_equals_numpy(calls[1:], results[1:])
    assert builder.combiner.launches == 2
    assert_each_equals_numpy(calls[:1], [builder.arrays_many(*calls[0])])


def test_the_lead_passes_on_when_the_leader_fails_outside_a_launch(triton_cpu) -> None:
    """A leader that fails before launching (here: taking its batch) still hands the lead to the oldest waiting
    call, so the calls queued behind it are served instead of waiting for ever."""
    calls = random_calls(5, [4, 4, 4])
    builder, _ = gated_builder(triton_cpu, queued=2)
    combiner = builder.combiner
    take_batch = combiner._take_batch
    taken = []

    def failing_once():
        taken.append(1)
        if len(taken) == 2:  # the second lead, before it takes its own call
            raise RuntimeError("batch")
        return take_batch()

    combiner._take_batch = failing_once
    results = in_threads(builder, calls)
    failed = [r for r in results if isinstance(r, RuntimeError)]
    assert len(failed) == 1 and str(failed[0]) == "batch"
    served = [(call, r) for call, r in zip(calls, results, strict=True) if not isinstance(r, Exception)]
    assert len(served) == 2
    assert_each_equals_numpy([c for c, _ in served], [r for _, r in served])
    assert not combiner._leading and combiner._queue == []


def test_one_thread_launches_each_call_at_once(triton_cpu) -> None:
    builder = TritonChunkBuilder("cpu", kernel=triton_cpu.kernel)
    calls = random_calls(4, [4, 128, 4])
    assert_each_equals_numpy(calls, [builder.arrays_many(*call) for call in calls])
    assert builder.combiner.launches == 3


@pytest.mark.parametrize("threads", [2, 8], ids=lambda n: f"{n}-threads")
def test_many_threads_many_calls_every_answer_equals_numpy(triton_cpu, threads: int) -> None:
    """No gate: whatever the timing, each of 8 calls per thread gets its own arrays."""
    builder = TritonChunkBuilder("cpu", kernel=triton_cpu.kernel)
    per_thread = [random_calls(10 + t, [4, 128, 4, 1, 4, 4, 128, 4]) for t in range(threads)]
    got: list[list] = [[] for _ in range(threads)]

    def worker(t: int) -> None:
        got[t] = [builder.arrays_many(*call) for call in per_thread[t]]

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=300)
    for t in range(threads):
        assert_each_equals_numpy(per_thread[t], got[t])
