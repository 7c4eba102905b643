"""Concurrent calls of the Triton backend share launches: :class:`LaunchCombiner`.

The launch itself (the copies, the kernel) is the caller's: ``kernels/triton_launcher.py`` passes its own.
A combined launch's program table is the calls' tables back to back, each call's token and row columns
shifted by where its outputs start in the combined outputs.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import numpy as np

from indexer_service.kernels.inputs import DcpConfig
from indexer_service.kernels.triton_kernel import KV_COLUMNS, ROW_COLUMNS

ChunkOutputs = tuple[np.ndarray, np.ndarray, np.ndarray]  # every chunk's token_to_seq, ks, ke of one call


class _Call:
    """One arrays_many call waiting in a :class:`LaunchCombiner`: its program table and output sizes, then its
    outputs or error. ``ready`` is set when either is there, or when the call's thread is to lead."""

    __slots__ = ("error", "group", "lead", "outputs", "ready", "rows", "table", "tokens")

    def __init__(self, table: np.ndarray, tokens: int, rows: int, group: tuple) -> None:
        self.table, self.tokens, self.rows, self.group = table, tokens, rows, group
        self.outputs: ChunkOutputs | None = None
        self.error: BaseException | None = None
        self.lead = False
        self.ready = threading.Event()

    def result(self) -> ChunkOutputs:
        if self.error is not None:
            # Each thread raises its own copy: one exception object raised in several threads would gather
            # all their frames in one traceback (and keep them alive); the launch's own error is the cause.
            raise copy.copy(self.error).with_traceback(None) from self.error
        assert self.outputs is not None
        return self.outputs


class LaunchCombiner:
    """Concurrent calls share launches: while one launch is in flight, the calls that arrive wait, and the next
    launch builds all of them (same compress ratio and DCP settings) from one combined program table, with one
    copy in and one copy out.

    Each launch costs fixed host work under the GIL (the launcher, the copies' and event's bookkeeping) and the
    driver serialises launches of one context, so eight threads launching one by one queue behind each other, each
    call many times slower than alone (docs/performance.md). A thread whose call is queued sleeps on its
    own event; the thread that leads launches batches until its own call is done, then hands the lead to the
    oldest waiting call. A lone call launches at once. ``launch(table, tokens, rows, dcp, ratio)`` returns the
    batch's token_to_seq, ks and ke, each call's back to back in batch order. A batch holds at most
    ``max_elements`` output elements; a larger call launches alone.
    """

    def __init__(self, launch: Callable[..., ChunkOutputs], max_elements: int) -> None:
        self._launch = launch
        self.max_elements = max_elements
        self._lock = threading.Lock()
        self._queue: list[_Call] = []
        self._leading = False
        self.launches = 0  # batches launched (tests and benchmarks)

    def run(self, table: np.ndarray, tokens: int, rows: int, dcp: DcpConfig, ratio: int) -> ChunkOutputs:
        call = _Call(table, tokens, rows, (ratio, dcp))
        with self._lock:
            self._queue.append(call)
            lead = not self._leading
            self._leading = True
        if not lead:
            call.ready.wait()
            if not call.lead:
                return call.result()
        try:
            while call.outputs is None and call.error is None:
                self._launch_batch(self._take_batch())
        finally:  # whatever happened here, the lead passes on: a lead kept by nobody would stall every call
            with self._lock:
                if call in self._queue:  # failed before its own call was taken: it leaves with the error
                    self._queue.remove(call)
                if self._queue:
                    successor = self._queue[0]
                    successor.lead = True
                    successor.ready.set()
                else:
                    self._leading = False
        return call.result()

    def _take_batch(self) -> list[_Call]:
        """The oldest call and the calls of its group behind it, in order, up to ``max_elements`` outputs."""
        with self._lock:
            first = self._queue[0]
            batch, size = [], 0
            for queued in self._queue:
                elements = queued.tokens + 2 * queued.rows
                if queued.group == first.group and (not batch or size + elements <= self.max_elements):
                    batch.append(queued)
                    size += elements
            self._queue = [queued for queued in self._queue if queued not in batch]
        return batch

    def _launch_batch(self, batch: list[_Call]) -> None:
        """One launch for ``batch``; each of its calls gets its outputs, or the error of any step."""
        ratio, dcp = batch[0].group
        kv_at, row_at = [0], [0]
        for queued in batch:
            kv_at.append(kv_at[-1] + queued.tokens)
            row_at.append(row_at[-1] + queued.rows)
        try:
            self.launches += 1
            if len(batch) == 1:
                table = batch[0].table
            else:
                table = np.concatenate([queued.table for queued in batch])
                starts = np.repeat(np.arange(len(batch)), [queued.table.shape[0] for queued in batch])
                table[:, KV_COLUMNS] += np.asarray(kv_at[:-1], dtype=table.dtype)[starts, None]
                table[:, ROW_COLUMNS] += np.asarray(row_at[:-1], dtype=table.dtype)[starts, None]
            all_tokens, all_ks, all_ke = self._launch(table, kv_at[-1], row_at[-1], dcp, ratio)
        except BaseException as exc:  # every call of the batch gets the launch's error
            for queued in batch:
                queued.error = exc
                queued.ready.set()
            return
        for n, queued in enumerate(batch):
            kv, row = slice(kv_at[n], kv_at[n + 1]), slice(row_at[n], row_at[n + 1])
            queued.outputs = (all_tokens[kv], all_ks[row], all_ke[row])
            queued.ready.set()
