"""The Triton kernel for one prefill chunk's metadata, and its host launcher.

Order as in Triton's tutorials: the reference lives in ``kernels/naive.py``; here are the kernel, the
launcher that takes torch tensors, and the chunk builder the service calls on a GPU.

One program per request of the chunk writes that request's ``token_to_seq`` entries and the
``[ks, ke)`` row window of each of its query rows inside the chunk's query slice.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.inputs import ChunkHostPart, ChunkInputs, ChunkMetadata, DcpConfig, assemble, chunk_host_part
from kernels.specialization import BLOCK_SIZE, SCALAR_ARGS, CompileKey, key_for_launch

# Scalars only bound masks or pick the DCP branch: specializing them on ==1 / %16 would multiply the
# compiled variants for no speed (see kernels/specialization.py and benchmarks/bench_specialization.py).
KERNEL_JIT_OPTIONS = {"do_not_specialize": list(SCALAR_ARGS)}


def _build_chunk_metadata_kernel_fn(
    query_start_ptr,  # [R+1] chunk-local query offsets q'
    seq_lens_ptr,  # [R] uncompressed sequence lengths
    cu_seq_lens_ptr,  # [R+1] cumulative compressed lengths
    local_cu_seq_lens_ptr,  # [R+1] this DCP rank's cumulative lengths (cu_seq_lens without DCP)
    token_to_seq_ptr,  # [T] out
    cu_seqlen_ks_ptr,  # [b-a] out
    cu_seqlen_ke_ptr,  # [b-a] out
    query_slice_start,
    query_slice_stop,
    dcp_rank,
    dcp_world_size,
    dcp_interleave,
    BLOCK_SIZE: tl.constexpr,
    COMPRESS_RATIO: tl.constexpr,
):
    req = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_SIZE)

    kv_lo = tl.load(cu_seq_lens_ptr + req)
    kv_hi = tl.load(cu_seq_lens_ptr + req + 1)
    # tl.full, not tl.zeros: zeros is a jit function of the standard library, which the in-process
    # interpreter cannot call.
    owner = tl.full([BLOCK_SIZE], 0, dtype=tl.int32) + req
    for block in range(kv_lo, kv_hi, BLOCK_SIZE):
        idx = block + offsets
        tl.store(token_to_seq_ptr + idx, owner, mask=idx < kv_hi)

    q_lo = tl.load(query_start_ptr + req)
    q_hi = tl.load(query_start_ptr + req + 1)
    first_position = tl.load(seq_lens_ptr + req) - (q_hi - q_lo)
    row_start = tl.load(local_cu_seq_lens_ptr + req)
    row_lo = tl.maximum(q_lo, query_slice_start)
    row_hi = tl.minimum(q_hi, query_slice_stop)
    for block in range(row_lo, row_hi, BLOCK_SIZE):
        rows = block + offsets
        mask = rows < row_hi
        # Causal position (uncompressed) of each row, then how many compressed tokens it may see.
        visible = first_position + 1 + (rows - q_lo)
        if COMPRESS_RATIO > 1:
            visible = visible // COMPRESS_RATIO
        if dcp_world_size > 1:
            # Compressed token g lives on rank (g // I) % W: keep only this rank's share of [0, visible).
            base = ((visible // dcp_interleave) // dcp_world_size) * dcp_interleave
            remainder = visible - base * dcp_world_size
            visible = base + tl.minimum(tl.maximum(remainder - dcp_rank * dcp_interleave, 0), dcp_interleave)
        out = rows - query_slice_start
        tl.store(cu_seqlen_ks_ptr + out, tl.full([BLOCK_SIZE], 0, dtype=tl.int32) + row_start, mask=mask)
        tl.store(cu_seqlen_ke_ptr + out, row_start + visible, mask=mask)


_build_chunk_metadata_kernel = triton.jit(_build_chunk_metadata_kernel_fn, **KERNEL_JIT_OPTIONS)


def interpreted_kernel():
    """The same kernel under Triton's CPU interpreter (tests on machines with no GPU)."""
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        return triton.jit(_build_chunk_metadata_kernel_fn, **KERNEL_JIT_OPTIONS)


def launch_scalars(query_slice: tuple[int, int], dcp: DcpConfig) -> tuple[int, ...]:
    """The kernel's scalar arguments, in SCALAR_ARGS order."""
    return (query_slice[0], query_slice[1], dcp.rank, dcp.world_size, dcp.interleave)


def launch_chunk_kernel(
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    local_cu_seq_lens: torch.Tensor,
    token_to_seq: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    *,
    query_slice: tuple[int, int],
    dcp: DcpConfig,
    compress_ratio: int,
    kernel=None,
    admit: Callable[[CompileKey], None] | None = None,
) -> CompileKey:
    """Launch the kernel on int32 tensors of one device; returns the compiled variant the launch used.

    ``compress_ratio`` must already be normalised. ``admit`` sees the variant before the launch and may
    refuse it by raising (the service's strict mode).
    """
    tensors = (
        query_start,
        seq_lens,
        cu_seq_lens,
        local_cu_seq_lens,
        token_to_seq,
        cu_seqlen_ks,
        cu_seqlen_ke,
    )
    scalars = launch_scalars(query_slice, dcp)
    key = key_for_launch(compress_ratio, [t.data_ptr() for t in tensors], scalars)
    if admit is not None:
        admit(key)
    num_requests = seq_lens.numel()
    if num_requests:
        (kernel or _build_chunk_metadata_kernel)[(num_requests,)](
            *tensors, *scalars, BLOCK_SIZE=BLOCK_SIZE, COMPRESS_RATIO=key.compress_ratio
        )
    return key


_ALIGN_ELEMS = 4  # 16 bytes of int32: every packed segment starts on Triton's aligned pointer class


def _padded(n: int) -> int:
    return -(-n // _ALIGN_ELEMS) * _ALIGN_ELEMS


def _alloc_output(num_elements: int, device: torch.device) -> torch.Tensor:
    # Every element that is returned is written by the kernel; tests swap this for a sentinel fill to
    # prove it (tests/test_triton_kernel.py).
    return torch.empty(num_elements, dtype=torch.int32, device=device)


def _pack(segments: list[np.ndarray]) -> tuple[np.ndarray, list[slice]]:
    """Concatenate int32 segments, each starting at a 16-byte-aligned offset (one host-to-device copy)."""
    offsets, total = [], 0
    for segment in segments:
        offsets.append(slice(total, total + segment.size))
        total += _padded(segment.size)
    packed = np.zeros(total, dtype=np.int32)
    for segment, where in zip(segments, offsets, strict=True):
        packed[where] = segment
    return packed, offsets


class TritonChunkBuilder:
    """Builds one chunk's metadata with the Triton kernel: one copy in, one launch, one copy out."""

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
        token_to_seq, ks, ke = self.arrays(host, inputs.dcp)
        return assemble(inputs, host, token_to_seq, ks, ke)

    def arrays(self, host: ChunkHostPart, dcp: DcpConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        segments = [host.query_start, host.seq_lens, host.cu_seq_lens]
        if dcp.enabled:
            segments.append(host.local_cu_seq_lens)
        packed, where = _pack([s.astype(np.int32) for s in segments])
        device_in = torch.from_numpy(packed).to(self.device)
        views = [device_in[w] for w in where]
        local_cu = views[3] if dcp.enabled else views[2]

        a, b = host.query_slice
        sizes = (host.total, b - a, b - a)
        out = _alloc_output(sum(_padded(n) for n in sizes), self.device)
        starts = np.cumsum([0] + [_padded(n) for n in sizes[:-1]])
        token_to_seq, ks, ke = (out[s : s + n] for s, n in zip(starts, sizes, strict=True))

        launch_chunk_kernel(
            views[0], views[1], views[2], local_cu, token_to_seq, ks, ke,
            query_slice=host.query_slice, dcp=dcp, compress_ratio=host.ratio,
            kernel=self.kernel, admit=self.admit,
        )  # fmt: skip
        result = out.cpu().numpy()
        return tuple(result[s : s + n] for s, n in zip(starts, sizes, strict=True))
