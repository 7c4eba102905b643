"""The Triton kernel for prefill chunk metadata, and its host launcher.

Order as in Triton's tutorials: the reference lives in ``kernels/naive.py``; here are the kernel, the
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

from collections.abc import Callable, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.inputs import (
    INT32_MAX,
    ChunkArrays,
    ChunkHostPart,
    ChunkInputs,
    ChunkMetadata,
    DcpConfig,
    assemble,
    chunk_host_part,
)
from kernels.specialization import BLOCK_SIZE, SCALAR_ARGS, CompileKey, key_for_launch

# The DCP scalars only pick a branch and bound a min/max: specializing them on ==1 / %16 would multiply the
# compiled variants for no speed (kernel times with and without: benchmarks/bench_kernel.py).
KERNEL_JIT_OPTIONS = {"do_not_specialize": list(SCALAR_ARGS)}

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
    pieces = np.maximum(1, -(-np.maximum(kv_hi - kv_lo, row_hi - row_lo) // PROGRAM_SPAN))
    if (pieces == 1).all():
        return table
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
    parts, kv_bases, row_bases = [], [], []
    kv_base = row_base = 0
    for host in hosts:
        starts = host.query_start
        a, b = host.query_slice
        row_lo = np.clip(starts[:-1], a, b)
        row_hi = np.clip(starts[1:], a, b)
        query_lens = starts[1:] - starts[:-1]
        cu = host.cu_seq_lens if with_token_to_seq else np.zeros_like(host.cu_seq_lens)
        column_values = (
            np.arange(cu.size - 1),
            kv_base + cu[:-1],
            kv_base + cu[1:],
            row_base + row_lo - a,
            row_base + row_hi - a,
            # Row r of request i sees position p0_i + 1 + (r - q'_i), with p0_i = S_i - q_i.
            host.seq_lens - query_lens + 1 + (row_lo - starts[:-1]),
            host.local_cu_seq_lens[:-1],
        )
        parts.append(np.stack(column_values, axis=1))
        kv_bases.append(kv_base)
        row_bases.append(row_base)
        kv_base += int(cu[-1])
        row_base += b - a
    if max(kv_base, row_base) > INT32_MAX:
        raise ValueError(f"outputs of {len(hosts)} chunks exceed int32 indexing ({kv_base} tokens, {row_base} rows)")
    table = np.concatenate(parts) if parts else np.zeros((0, len(TABLE_COLUMNS)), dtype=np.int64)
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
    # prove it (tests/test_chunk_metadata.py).
    return torch.empty(num_elements, dtype=torch.int32, device=device)


class TritonChunkBuilder:
    """Builds chunk metadata with the Triton kernel: one copy in, one launch, one copy out per call."""

    def __init__(
        self,
        device: str | torch.device = "cuda",
        kernel=None,
        admit: Callable[[CompileKey], None] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.kernel = kernel
        self.admit = admit

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
            host_out = self._launch(table, tokens, rows, dcp, ratios.pop())
        except torch.OutOfMemoryError as exc:
            # Give the cached blocks back so the next request starts from a clean pool, and let the caller
            # answer RESOURCE_EXHAUSTED: the process stays healthy.
            torch.cuda.empty_cache()
            raise MemoryError(f"GPU out of memory for {tokens} tokens and {rows} rows: {exc}") from exc
        all_tokens, all_ks, all_ke = (host_out[where] for where in _output_segments(tokens, rows)[1])
        return [
            (all_tokens[kv_lo:kv_hi], all_ks[row_lo:row_hi], all_ke[row_lo:row_hi])
            for kv_lo, kv_hi, row_lo, row_hi in zip(
                kv_bases[:-1], kv_bases[1:], row_bases[:-1], row_bases[1:], strict=True
            )
        ]

    def _launch(self, table: np.ndarray, tokens: int, rows: int, dcp: DcpConfig, ratio: int) -> np.ndarray:
        """Table in, one launch, every output back to the host as one int32 array (segments 16-byte aligned)."""
        device_table = torch.from_numpy(table).to(self.device)
        size, segments = _output_segments(tokens, rows)
        out = _alloc_output(size, self.device)
        token_to_seq, ks, ke = (out[where] for where in segments)
        launch_prefill_metadata_kernel(
            device_table, token_to_seq, ks, ke, dcp=dcp, compress_ratio=ratio, kernel=self.kernel, admit=self.admit
        )
        return out.cpu().numpy()
