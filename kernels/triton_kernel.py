"""The Triton kernel for prefill chunk metadata: its device code, the program table's columns it reads, and the
one function that launches it on tensors.

Order as in Triton's tutorials: the oracle lives in ``kernels/reference.py``; the host side that builds the
program table, stages the copies and combines concurrent calls is ``kernels/triton_launcher.py`` and
``kernels/launch_combiner.py``.

vLLM launches one program per request of one chunk and passes the chunk's query slice and DCP settings as scalars. Here
the host first writes a *program table*: one row per (chunk, request), or several for a long request, holding where the
request's ``token_to_seq`` entries and output rows go and the causal position of its first output row. The kernel then
needs no per-chunk scalar, so every chunk of a prefill plan is built by **one launch** from one host-to-device copy,
with one device-to-host copy back; the query slice stops being a specialization axis.
"""

from __future__ import annotations

import ast
import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import triton
import triton.language as tl

from indexer_service.kernels.inputs import DcpConfig
from indexer_service.kernels.specialization import BLOCK_SIZE, SCALAR_ARGS, CompileKey, key_for_launch

if TYPE_CHECKING:  # the launch's tensors; the kernel itself never needs torch imported (seconds, on a CPU start)
    import torch
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    # What triton.jit makes of the kernel: compiled for a device, or run by Triton's CPU interpreter.
    Kernel = JITFunction | InterpretedFunction

# The DCP scalars only pick a branch and bound a min/max: specializing them on ==1 / %16 would multiply the
# compiled variants for no speed (kernel times with and without: benchmarks/bench_kernel.py).
KERNEL_JIT_OPTIONS = {"do_not_specialize": list(SCALAR_ARGS)}

# ast.parse takes this lock in every thread (see serialise_ast_parse). Re-entrant: a finalizer run by the
# garbage collector in the middle of a parse may itself parse.
_AST_PARSE_LOCK = threading.RLock()


def serialise_ast_parse() -> None:
    """Make ``ast.parse`` take one process-wide lock, for good (idempotent).

    Called where compiles start, not on import: :class:`~indexer_service.kernels.triton_launcher.TritonChunkBuilder`
    (a launch compiles its variant the first time, or interprets the kernel) and
    :func:`~indexer_service.kernels.compile_engine.compile_keys` (the warmup, whose compiles run in parallel).

    Why: CPython 3.11 keeps the AST constructor's recursion depth in interpreter-wide state. When two threads
    parse at once and the garbage collector switches threads in the middle of one, the other's count is
    corrupted and its parse fails with ``SystemError: AST constructor recursion depth mismatch`` (the message
    of CPython gh-106905, whose fix covers an error path, not threads). Triton parses the kernel's source in
    every thread that compiles it (the parallel warmup) or first interprets it, so a parallel ahead-of-time
    compile can lose a key this way. A kernel parses in about a millisecond, so the lock costs nothing a
    warmup can measure; it is installed on every Python version for that reason.

    Not covered: ``compile(..., ast.PyCF_ONLY_AST)`` called directly (nothing here does). A garbage-collector
    finaliser that, in the middle of a parse, waited for another thread's parse would deadlock on this lock.
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


# Columns of the program table, one row per (chunk, request).
TABLE_COLUMNS = ("owner", "kv_lo", "kv_hi", "row_lo", "row_hi", "first_position", "row_start")
_TABLE_WIDTH = tl.constexpr(len(TABLE_COLUMNS))
# The columns that index the outputs (token ranges, row ranges): moved when outputs are laid out back to back.
KV_COLUMNS = slice(TABLE_COLUMNS.index("kv_lo"), TABLE_COLUMNS.index("kv_hi") + 1)
ROW_COLUMNS = slice(TABLE_COLUMNS.index("row_lo"), TABLE_COLUMNS.index("row_hi") + 1)


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


def interpreted_kernel() -> Kernel:
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
    kernel: Kernel | None = None,
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
