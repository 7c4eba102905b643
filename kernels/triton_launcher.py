"""The Triton kernel for prefill chunk metadata, and its host launcher.

Order as in Triton's tutorials: the reference lives in ``kernels/numpy_backend.py``; here are the kernel, the
launcher that takes torch tensors, and the builder the service calls on a GPU.

vLLM launches one program per request of one chunk and passes the chunk's query slice and DCP settings
as scalars. Here the host first writes a *program table*: one row per (chunk, request), or several for a
long request, holding where the request's ``token_to_seq`` entries and output rows go and the causal
position of its first output row.
The kernel then needs no per-chunk scalar, so every chunk of a prefill plan is built by **one launch**
from one host-to-device copy, with one device-to-host copy back; the query slice stops being a
specialization axis.
"""

from __future__ import annotations

import ast
import copy
import functools
import threading
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from indexer_service.kernels.formulas import causal_position
from indexer_service.kernels.inputs import (
    INT32_MAX,
    ChunkArrays,
    ChunkHostPart,
    ChunkInputs,
    ChunkMetadata,
    DcpConfig,
    assemble,
    chunk_host_part,
)
from indexer_service.kernels.specialization import BLOCK_SIZE, SCALAR_ARGS, CompileKey, key_for_launch

# The DCP scalars only pick a branch and bound a min/max: specializing them on ==1 / %16 would multiply the
# compiled variants for no speed (kernel times with and without: benchmarks/bench_kernel.py).
KERNEL_JIT_OPTIONS = {"do_not_specialize": list(SCALAR_ARGS)}

# ast.parse takes this lock in every thread (see serialise_ast_parse). Re-entrant: a finalizer run by the
# garbage collector in the middle of a parse may itself parse.
_AST_PARSE_LOCK = threading.RLock()


def serialise_ast_parse() -> None:
    """Make ``ast.parse`` take one process-wide lock; installed once, on importing this module.

    Why: CPython 3.11 keeps the AST constructor's recursion depth in interpreter-wide state. When two threads
    parse at once and the garbage collector switches threads in the middle of one, the other's count is
    corrupted and its parse fails with ``SystemError: AST constructor recursion depth mismatch`` (the message
    of CPython gh-106905, whose fix covers an error path, not threads). Triton parses the kernel's source in
    every thread that compiles it (the parallel warmup) or first interprets it; a parallel ahead-of-time
    compile in CI lost a key this way. A kernel parses in about a millisecond, so the lock costs nothing a
    warmup can measure; it is installed on every Python version for that reason.

    Not covered: ``compile(..., ast.PyCF_ONLY_AST)`` called directly (nothing here does). A garbage-collector
    finaliser that, in the middle of a parse, waited for another thread's parse would now deadlock instead.
    """
    if getattr(ast.parse, "serialised", False):
        return
    unlocked_parse = ast.parse

    @functools.wraps(unlocked_parse)
    def parse(*args, **kwargs):
        with _AST_PARSE_LOCK:
            return unlocked_parse(*args, **kwargs)

    parse.serialised = True
    ast.parse = parse


serialise_ast_parse()

# Columns of the program table, one row per (chunk, request).
TABLE_COLUMNS = ("owner", "kv_lo", "kv_hi", "row_lo", "row_hi", "first_position", "row_start")
_TABLE_WIDTH = tl.constexpr(len(TABLE_COLUMNS))


def _build_prefill_metadata_kernel_fn(
    program_table_ptr,  # [P, 7] int32, columns TABLE_COLUMNS
    token_to_seq_ptr,  # out: every chunk's token_to_seq, back to back
    cu_seqlen_ks_ptr,  # out: every chunk's ks rows, back to back
    cu_seqlen_ke_ptr,  # out: every chunk's ke rows, back to back
    dcp_rank,
    dcp_world_size,
    dcp_interleave,
    BLOCK_SIZE: tl.constexpr,
    COMPRESS_RATIO: tl.constexpr,
):
    row = program_table_ptr + tl.program_id(0) * _TABLE_WIDTH
    owner = tl.load(row + 0)  # the request's index inside its chunk
    kv_lo = tl.load(row + 1)
    kv_hi = tl.load(row + 2)
    row_lo = tl.load(row + 3)
    row_hi = tl.load(row + 4)
    first_position = tl.load(row + 5)  # uncompressed causal position of output row row_lo
    row_start = tl.load(row + 6)  # this rank's first KV row of the request: every ks

    offsets = tl.arange(0, BLOCK_SIZE)
    # tl.full, not tl.zeros: zeros is a jit function of the standard library, which the in-process
    # interpreter cannot call.
    owner_block = tl.full([BLOCK_SIZE], 0, dtype=tl.int32) + owner
    for block in range(kv_lo, kv_hi, BLOCK_SIZE):
        idx = block + offsets
        tl.store(token_to_seq_ptr + idx, owner_block, mask=idx < kv_hi)

    ks_block = tl.full([BLOCK_SIZE], 0, dtype=tl.int32) + row_start
    for block in range(row_lo, row_hi, BLOCK_SIZE):
        rows = block + offsets
        mask = rows < row_hi
        visible = first_position + (rows - row_lo)
        if COMPRESS_RATIO > 1:
            visible = visible // COMPRESS_RATIO
        if dcp_world_size > 1:
            # Compressed token g lives on rank (g // I) % W: keep only this rank's share of [0, visible).
            base = ((visible // dcp_interleave) // dcp_world_size) * dcp_interleave
            remainder = visible - base * dcp_world_size
            visible = base + tl.minimum(tl.maximum(remainder - dcp_rank * dcp_interleave, 0), dcp_interleave)
        tl.store(cu_seqlen_ks_ptr + rows, ks_block, mask=mask)
        tl.store(cu_seqlen_ke_ptr + rows, row_start + visible, mask=mask)


_build_prefill_metadata_kernel = triton.jit(_build_prefill_metadata_kernel_fn, **KERNEL_JIT_OPTIONS)


def interpreted_kernel():
    """The same kernel under Triton's CPU interpreter (tests on machines with no GPU)."""
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        return triton.jit(_build_prefill_metadata_kernel_fn, **KERNEL_JIT_OPTIONS)


def launch_scalars(dcp: DcpConfig) -> tuple[int, ...]:
    """The kernel's scalar arguments, in SCALAR_ARGS order."""
    return (dcp.rank, dcp.world_size, dcp.interleave)


def launch_prefill_metadata_kernel(
    program_table: torch.Tensor,
    token_to_seq: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    *,
    dcp: DcpConfig,
    compress_ratio: int,
    kernel=None,
    admit: Callable[[CompileKey], None] | None = None,
) -> CompileKey:
    """Launch the kernel on int32 tensors of one device; returns the compiled variant the launch used.

    ``compress_ratio`` must already be normalised. ``admit`` sees the variant before the launch and may
    refuse it by raising (the service's strict mode).
    """
    tensors = (program_table, token_to_seq, cu_seqlen_ks, cu_seqlen_ke)
    scalars = launch_scalars(dcp)
    key = key_for_launch(compress_ratio, [t.data_ptr() for t in tensors], scalars)
    if admit is not None:
        admit(key)
    programs = program_table.shape[0]
    if programs:
        (kernel or _build_prefill_metadata_kernel)[(programs,)](
            *tensors, *scalars, BLOCK_SIZE=BLOCK_SIZE, COMPRESS_RATIO=key.compress_ratio
        )
    return key


# Most elements of one kind (tokens or rows) a program writes: a long request gets several programs, so one
# 86k-token request is not a single program walking 85 blocks in turn.
PROGRAM_SPAN = 8 * BLOCK_SIZE


def _split_long_requests(table: np.ndarray) -> np.ndarray:
    """Each row of the table cut into pieces of at most PROGRAM_SPAN tokens and PROGRAM_SPAN rows."""
    kv_lo, kv_hi, row_lo, row_hi = table[:, 1], table[:, 2], table[:, 3], table[:, 4]
    longest = np.maximum(kv_hi - kv_lo, row_hi - row_lo)
    if table.shape[0] == 0 or longest.max() <= PROGRAM_SPAN:  # the common case, in two array operations
        return table
    pieces = np.maximum(1, -(-longest // PROGRAM_SPAN))
    split = np.repeat(table, pieces, axis=0)
    step = (np.arange(split.shape[0]) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * PROGRAM_SPAN
    new_kv_lo = np.minimum(split[:, 1] + step, split[:, 2])
    new_row_lo = np.minimum(split[:, 3] + step, split[:, 4])
    split[:, 5] += new_row_lo - split[:, 3]  # the causal position moves with the first row
    split[:, 2] = np.minimum(new_kv_lo + PROGRAM_SPAN, split[:, 2])
    split[:, 4] = np.minimum(new_row_lo + PROGRAM_SPAN, split[:, 4])
    split[:, 1], split[:, 3] = new_kv_lo, new_row_lo
    return split


def program_table(
    hosts: Sequence[ChunkHostPart], with_token_to_seq: bool = True
) -> tuple[np.ndarray, list[int], list[int]]:
    """The program table of several chunks, and where each chunk's token_to_seq and rows start.

    Without ``token_to_seq`` every program's token range is empty: a caller that omits it (often the largest
    output) neither computes nor holds it.
    """
    kv_bases, row_bases = [], []
    kv_base = row_base = 0
    # Every chunk's rows written into one table in place: per chunk a handful of array operations, no
    # stacking or concatenation (this is per-call host work under the GIL, which concurrent calls queue on).
    table = np.empty((sum(host.cu_seq_lens.size - 1 for host in hosts), len(TABLE_COLUMNS)), dtype=np.int64)
    at = 0
    for host in hosts:
        starts = host.query_start
        a, b = host.query_slice
        rows = table[at : at + starts.size - 1]
        at += starts.size - 1
        # row_lo and row_hi: the request's query rows clipped to the slice [a, b)
        np.minimum(np.maximum(starts[:-1], a), b, out=rows[:, 3])
        np.minimum(np.maximum(starts[1:], a), b, out=rows[:, 4])
        rows[:, 5] = causal_position(host.seq_lens, starts[1:] - starts[:-1], rows[:, 3] - starts[:-1])
        rows[:, 3:5] += row_base - a
        rows[:, 0] = np.arange(rows.shape[0])
        if with_token_to_seq:
            rows[:, 1] = host.cu_seq_lens[:-1]
            rows[:, 2] = host.cu_seq_lens[1:]
            rows[:, 1:3] += kv_base
        else:
            rows[:, 1:3] = kv_base
        rows[:, 6] = host.local_cu_seq_lens[:-1]
        kv_bases.append(kv_base)
        row_bases.append(row_base)
        kv_base += int(host.cu_seq_lens[-1]) if with_token_to_seq else 0
        row_base += b - a
    if max(kv_base, row_base) > INT32_MAX:
        raise ValueError(f"outputs of {len(hosts)} chunks exceed int32 indexing ({kv_base} tokens, {row_base} rows)")
    return _split_long_requests(table).astype(np.int32), [*kv_bases, kv_base], [*row_bases, row_base]


_ALIGN_ELEMS = 4  # 16 bytes of int32: every buffer segment starts on Triton's aligned pointer class


def _padded(n: int) -> int:
    return -(-n // _ALIGN_ELEMS) * _ALIGN_ELEMS


def _output_segments(tokens: int, rows: int) -> tuple[int, tuple[slice, slice, slice]]:
    """Size of the one output buffer, and where token_to_seq, ks and ke lie in it (16-byte aligned)."""
    ks_at, ke_at = _padded(tokens), _padded(tokens) + _padded(rows)
    return ke_at + _padded(rows), (slice(0, tokens), slice(ks_at, ks_at + rows), slice(ke_at, ke_at + rows))


def _alloc_output(num_elements: int, device: torch.device) -> torch.Tensor:
    # Every element that is returned is written by the kernel; tests swap this for a sentinel fill to
    # prove it (tests/test_chunk_metadata.py). Used where no CUDA stream is involved (the interpreter on CPU).
    return torch.empty(num_elements, dtype=torch.int32, device=device)


class PinnedPool:
    """Page-locked host buffers, reused across calls: page-locking costs far more than a copy, so never per call.

    Buffers come in power-of-two size classes (at least 64 KiB); released ones are kept for the next acquire of
    their class, up to ``max_idle_bytes`` in all and ``max_kept_bytes`` each (a rare huge answer does not pin
    host memory for the life of the process). ``allocations`` counts page-locked allocations (tests).
    """

    MIN_CLASS = 1 << 16

    def __init__(self, max_idle_bytes: int = 256 << 20, max_kept_bytes: int = 64 << 20) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.max_kept_bytes = max_kept_bytes
        self.allocations = 0
        self._free: dict[int, list[torch.Tensor]] = {}
        self._idle = 0
        # Reentrant: a lease's finaliser may run (garbage collection) while this thread holds the lock.
        self._lock = threading.RLock()

    @classmethod
    def size_class(cls, nbytes: int) -> int:
        return max(cls.MIN_CLASS, 1 << max(0, nbytes - 1).bit_length())

    def acquire(self, nbytes: int) -> torch.Tensor:
        size = self.size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                self._idle -= size
                return free.pop()
            self.allocations += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def release(self, buffer: torch.Tensor) -> None:
        size = buffer.numel()
        with self._lock:
            if size <= self.max_kept_bytes and self._idle + size <= self.max_idle_bytes:
                self._free.setdefault(size, []).append(buffer)
                self._idle += size

    def idle_bytes(self) -> int:
        with self._lock:
            return self._idle


def _leased_array(pool: PinnedPool, buffer: torch.Tensor, count: int) -> np.ndarray:
    """``count`` int32 of a pooled page-locked buffer as a numpy array, no copy: the buffer returns to the pool
    when the last array viewing it (slices included) is gone."""
    array = np.frombuffer(buffer.numpy(), dtype=np.int32, count=count)
    # The array's base chain ends at ``buffer``'s numpy view; a finaliser on a holder object that only the
    # array references tells when numpy has dropped it.
    holder = _Lease(array)
    weakref.finalize(holder, pool.release, buffer)
    return np.asarray(holder)


class _Lease:
    """Exposes an array through ``__array_interface__`` so that arrays made from it keep it (their base)."""

    __slots__ = ("__array_interface__", "__weakref__", "_array")

    def __init__(self, array: np.ndarray) -> None:
        self._array = array
        self.__array_interface__ = array.__array_interface__


class _Stage:
    """One thread's CUDA stream, completion event and reusable device buffers (grown, never per call)."""

    # Device output kept per thread; a larger answer gets its own allocation for the call.
    KEEP_ELEMENTS = 16 << 20

    def __init__(self, device: torch.device, blocking: bool) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        # A blocking event sleeps in the driver instead of spinning: right when threads outnumber cores.
        self.done = torch.cuda.Event(blocking=blocking)
        self.table_host = torch.empty(0, dtype=torch.int32, pin_memory=True)
        self.table_host_np = self.table_host.numpy()
        self.table_device = torch.empty(0, dtype=torch.int32, device=device)
        self.out_device = torch.empty(0, dtype=torch.int32, device=device)

    def table(self, table: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The table copied into this thread's page-locked staging buffer; (host view, device view)."""
        n = table.size
        if self.table_host.numel() < n:
            grown = max(n, 2 * self.table_host.numel(), 4096)
            self.table_host = torch.empty(grown, dtype=torch.int32, pin_memory=True)
            self.table_host_np = self.table_host.numpy()
            self.table_device = torch.empty(grown, dtype=torch.int32, device=self.device)
        np.copyto(self.table_host_np[:n], table.reshape(-1))
        return self.table_host[:n], self.table_device[:n]

    def output(self, size: int) -> torch.Tensor:
        if size > self.KEEP_ELEMENTS:
            return torch.empty(size, dtype=torch.int32, device=self.device)
        if self.out_device.numel() < size:
            self.out_device = torch.empty(
                min(self.KEEP_ELEMENTS, max(size, 2 * self.out_device.numel())), dtype=torch.int32, device=self.device
            )
        return self.out_device[:size]


# Columns of the program table that index the outputs: token ranges and row ranges. A combined launch shifts
# each call's rows by where its outputs start in the combined buffer.
_KV_COLUMNS, _ROW_COLUMNS = slice(1, 3), slice(3, 5)
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
    driver serialises launches of one context, so eight threads launching one by one queue behind each other
    (issue 12: 8 threads took 13 to 25 times the one-thread time). A thread whose call is queued sleeps on its
    own event; the thread that leads launches batches until its own call is done, then hands the lead to the
    oldest waiting call. A lone call launches at once. ``launch(table, tokens, rows, dcp, ratio)`` returns the
    outputs buffer laid out by :func:`_output_segments`. A batch holds at most ``max_elements`` output elements;
    a larger call launches alone.
    """

    def __init__(self, launch: Callable[..., np.ndarray], max_elements: int) -> None:
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
                table[:, _KV_COLUMNS] += np.asarray(kv_at[:-1], dtype=table.dtype)[starts, None]
                table[:, _ROW_COLUMNS] += np.asarray(row_at[:-1], dtype=table.dtype)[starts, None]
            host_out = self._launch(table, kv_at[-1], row_at[-1], dcp, ratio)
            all_tokens, all_ks, all_ke = (host_out[where] for where in _output_segments(kv_at[-1], row_at[-1])[1])
        except BaseException as exc:  # every call of the batch gets the launch's error
            for queued in batch:
                queued.error = exc
                queued.ready.set()
            return
        for n, queued in enumerate(batch):
            kv, row = slice(kv_at[n], kv_at[n + 1]), slice(row_at[n], row_at[n + 1])
            queued.outputs = (all_tokens[kv], all_ks[row], all_ke[row])
            queued.ready.set()


def _default_blocking_wait() -> bool:
    """Sleep while waiting for the GPU where a spinning waiter would take a core a serving thread needs."""
    import os

    return len(os.sched_getaffinity(0)) < 8


class TritonChunkBuilder:
    """Builds chunk metadata with the Triton kernel: one copy in, one launch, one copy out per launch, and
    concurrent calls share launches (:class:`LaunchCombiner`; ``combine=False`` launches each call alone).

    On CUDA each calling thread has its own stream, event and device buffers, the program table goes through a
    page-locked staging buffer and the outputs come back into a pooled page-locked buffer that the returned
    arrays view without another copy (it returns to the pool when they are gone). The thread waits for its
    event with the GIL released, so concurrent calls overlap their copies and launches instead of queueing
    on the default stream and on pageable copies. ``poison`` fills the device output before the launch (the
    warmup's proof: an element the kernel does not write shows).
    """

    def __init__(
        self,
        device: str | torch.device = "cuda",
        kernel=None,
        admit: Callable[[CompileKey], None] | None = None,
        *,
        pool: PinnedPool | None = None,
        blocking_wait: bool | None = None,
        poison: int | None = None,
        combine: bool = True,
    ) -> None:
        self.device = torch.device(device)
        self.kernel = kernel
        self.admit = admit
        self.poison = poison
        self._cuda = self.device.type == "cuda"
        self.pool = pool if pool is not None else (PinnedPool() if self._cuda else None)
        self.blocking_wait = _default_blocking_wait() if blocking_wait is None else blocking_wait
        self._local = threading.local()
        self._launch = self._launch_cuda if self._cuda else self._launch_plain
        self.combiner = LaunchCombiner(self._launch, _Stage.KEEP_ELEMENTS) if combine else None

    def __call__(self, inputs: ChunkInputs) -> ChunkMetadata | None:
        host = chunk_host_part(inputs)
        if host is None:
            return None
        return assemble(inputs, host, *self.arrays(host, inputs.dcp))

    def arrays(self, host: ChunkHostPart, dcp: DcpConfig, with_token_to_seq: bool = True) -> ChunkArrays:
        """``token_to_seq`` (empty when not wanted), ``cu_seqlen_ks`` and ``cu_seqlen_ke`` of one chunk."""
        return self.arrays_many([host], dcp, with_token_to_seq)[0]

    def arrays_many(
        self, hosts: Sequence[ChunkHostPart], dcp: DcpConfig, with_token_to_seq: bool = True
    ) -> list[ChunkArrays]:
        """The three arrays of every chunk (same ratio, same DCP settings), from a single launch."""
        if not hosts:
            return []
        ratios = {host.ratio for host in hosts}
        if len(ratios) != 1:
            raise ValueError(f"one launch builds chunks of one compress ratio, got {sorted(ratios)}")
        table, kv_bases, row_bases = program_table(hosts, with_token_to_seq)
        tokens, rows = kv_bases[-1], row_bases[-1]
        try:
            all_tokens, all_ks, all_ke = self._outputs(table, tokens, rows, dcp, ratios.pop())
        except torch.OutOfMemoryError as exc:
            # Give the cached blocks back so the next request starts from a clean pool, and let the caller
            # answer RESOURCE_EXHAUSTED: the process stays healthy.
            torch.cuda.empty_cache()
            raise MemoryError(f"GPU out of memory for {tokens} tokens and {rows} rows: {exc}") from exc
        return [
            (all_tokens[kv_lo:kv_hi], all_ks[row_lo:row_hi], all_ke[row_lo:row_hi])
            for kv_lo, kv_hi, row_lo, row_hi in zip(
                kv_bases[:-1], kv_bases[1:], row_bases[:-1], row_bases[1:], strict=True
            )
        ]

    def _outputs(self, table: np.ndarray, tokens: int, rows: int, dcp: DcpConfig, ratio: int) -> ChunkOutputs:
        """This call's token_to_seq, ks and ke (every chunk's, back to back): from a launch shared with the
        concurrent calls (the combiner), or from a launch of its own."""
        if self.combiner is not None:
            return self.combiner.run(table, tokens, rows, dcp, ratio)
        host_out = self._launch(table, tokens, rows, dcp, ratio)
        all_tokens, all_ks, all_ke = (host_out[where] for where in _output_segments(tokens, rows)[1])
        return all_tokens, all_ks, all_ke

    def _launch_plain(self, table: np.ndarray, tokens: int, rows: int, dcp: DcpConfig, ratio: int) -> np.ndarray:
        """No CUDA (the interpreter on CPU): plain tensors, the current stream."""
        device_table = torch.from_numpy(table).to(self.device)
        size, segments = _output_segments(tokens, rows)
        out = _alloc_output(size, self.device)
        if self.poison is not None:
            out.fill_(self.poison)
        token_to_seq, ks, ke = (out[where] for where in segments)
        launch_prefill_metadata_kernel(
            device_table, token_to_seq, ks, ke, dcp=dcp, compress_ratio=ratio, kernel=self.kernel, admit=self.admit
        )
        return out.cpu().numpy()

    def _stage(self) -> _Stage:
        stage = getattr(self._local, "stage", None)
        if stage is None:
            stage = self._local.stage = _Stage(self.device, self.blocking_wait)
        return stage

    def _launch_cuda(self, table: np.ndarray, tokens: int, rows: int, dcp: DcpConfig, ratio: int) -> np.ndarray:
        """Table in through page-locked staging, one launch on this thread's stream, every output back into a
        pooled page-locked buffer, one wait with the GIL released; the result views that buffer."""
        size, segments = _output_segments(tokens, rows)
        if size == 0 and table.shape[0] == 0:
            return np.zeros(0, dtype=np.int32)
        stage = self._stage()
        table_host, table_device = stage.table(table)
        out = stage.output(size)
        buffer = self.pool.acquire(4 * size)
        try:
            with torch.cuda.stream(stage.stream):
                table_device.copy_(table_host, non_blocking=True)
                if self.poison is not None:
                    out.fill_(self.poison)
                token_to_seq, ks, ke = (out[where] for where in segments)
                launch_prefill_metadata_kernel(
                    table_device.view(-1, len(TABLE_COLUMNS)),
                    token_to_seq,
                    ks,
                    ke,
                    dcp=dcp,
                    compress_ratio=ratio,
                    kernel=self.kernel,
                    admit=self.admit,
                )
                buffer[: 4 * size].view(torch.int32).copy_(out, non_blocking=True)
                stage.done.record(stage.stream)
            stage.done.synchronize()  # torch releases the GIL while the driver waits
        except BaseException:
            # Nothing may still write into the buffer when another call gets it.
            stage.stream.synchronize()
            self.pool.release(buffer)
            raise
        return _leased_array(self.pool, buffer, size)
