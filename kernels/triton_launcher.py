"""The Triton backend's host side: the program table, the page-locked pool and per-thread staging, and the
builder the service calls on a GPU (:class:`TritonChunkBuilder`).

The kernel and the one function that launches it are ``kernels/triton_kernel.py``; concurrent calls share
launches through ``kernels/launch_combiner.py``. Its outputs equal ``kernels/reference.py``'s (the oracle) for
every valid input. torch is imported by the CUDA path alone: on a CPU (Triton's interpreter: the warmup's proof with
no GPU, tests) the builder launches on numpy arrays (kernels/host_tensor.py), so a CPU server never imports it.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from indexer_service.kernels.formulas import causal_position
from indexer_service.kernels.host_tensor import HostTensor, aligned_empty
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
from indexer_service.kernels.launch_combiner import ChunkOutputs, LaunchCombiner
from indexer_service.kernels.specialization import BLOCK_SIZE, CompileKey
from indexer_service.kernels.triton_kernel import TABLE_COLUMNS, launch_prefill_metadata_kernel, serialise_ast_parse

if TYPE_CHECKING:
    import torch

    from indexer_service.kernels.triton_kernel import Kernel

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


def _alloc_output(num_elements: int) -> np.ndarray:
    # Every element that is returned is written by the kernel; tests swap this for a sentinel fill to
    # prove it (tests/kernels/test_chunk_metadata.py). Used where no CUDA stream is involved (the interpreter on CPU).
    return aligned_empty(num_elements)


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
        import torch

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
        import torch

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
            import torch

            grown = max(n, 2 * self.table_host.numel(), 4096)
            self.table_host = torch.empty(grown, dtype=torch.int32, pin_memory=True)
            self.table_host_np = self.table_host.numpy()
            self.table_device = torch.empty(grown, dtype=torch.int32, device=self.device)
        np.copyto(self.table_host_np[:n], table.reshape(-1))
        return self.table_host[:n], self.table_device[:n]

    def output(self, size: int) -> torch.Tensor:
        if size <= self.out_device.numel():
            return self.out_device[:size]
        import torch  # here, not above: this runs on every launch, and most find their buffer

        if size > self.KEEP_ELEMENTS:
            return torch.empty(size, dtype=torch.int32, device=self.device)
        self.out_device = torch.empty(
            min(self.KEEP_ELEMENTS, max(size, 2 * self.out_device.numel())), dtype=torch.int32, device=self.device
        )
        return self.out_device[:size]


def _default_blocking_wait() -> bool:
    """Sleep while waiting for the GPU where a spinning waiter would take a core a serving thread needs."""
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
        kernel: Kernel | None = None,
        admit: Callable[[CompileKey], None] | None = None,
        *,
        pool: PinnedPool | None = None,
        blocking_wait: bool | None = None,
        poison: int | None = None,
        combine: bool = True,
    ) -> None:
        serialise_ast_parse()  # this builder's launches compile (or interpret) the kernel, parsing its source
        self._cuda = str(device).split(":")[0] == "cuda"
        if self._cuda:
            import torch

            self.device: torch.device | str = torch.device(device)
            self._out_of_memory: tuple[type[BaseException], ...] = (torch.OutOfMemoryError,)
        else:  # Triton's interpreter, on numpy arrays
            self.device, self._out_of_memory = str(device), ()
        self.kernel = kernel
        self.admit = admit
        self.poison = poison
        self.pool = pool if pool is not None else (PinnedPool() if self._cuda else None)
        self.blocking_wait = _default_blocking_wait() if blocking_wait is None else blocking_wait
        self._local = threading.local()
        self._launch_buffer = self._launch_cuda if self._cuda else self._launch_plain
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
        except self._out_of_memory as exc:
            # Give the cached blocks back so the next request starts from a clean pool, and let the caller
            # answer RESOURCE_EXHAUSTED: the process stays healthy.
            import torch

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
        return self._launch(table, tokens, rows, dcp, ratio)

    def _launch(self, table: np.ndarray, tokens: int, rows: int, dcp: DcpConfig, ratio: int) -> ChunkOutputs:
        """One launch for ``table``: its token_to_seq, ks and ke, views of the one output buffer."""
        host_out = self._launch_buffer(table, tokens, rows, dcp, ratio)
        all_tokens, all_ks, all_ke = (host_out[where] for where in _output_segments(tokens, rows)[1])
        return all_tokens, all_ks, all_ke

    def _launch_plain(self, table: np.ndarray, tokens: int, rows: int, dcp: DcpConfig, ratio: int) -> np.ndarray:
        """No CUDA (the interpreter on CPU): numpy arrays, in aligned buffers as torch's would be, the kernel writing
        into the returned one."""
        aligned_table = aligned_empty(table.shape, table.dtype)
        np.copyto(aligned_table, table)
        size, segments = _output_segments(tokens, rows)
        out = _alloc_output(size)
        if self.poison is not None:
            out.fill(self.poison)
        token_to_seq, ks, ke = (HostTensor(out[where]) for where in segments)
        launch_prefill_metadata_kernel(
            HostTensor(aligned_table),
            token_to_seq,
            ks,
            ke,
            dcp=dcp,
            compress_ratio=ratio,
            kernel=self.kernel,
            admit=self.admit,
        )
        return out

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
        import torch

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
