"""The baseline the benchmarks compare against: vLLM's way of building prefill chunk metadata, written by
this project from the spec (sections 1 and 4), not copied.

* One launch per chunk, one program per request, the query slice and DCP settings as scalars that Triton
  specializes (1 / divisible by 16 / generic), ``seq_lens[s:e]`` passed as a view (unaligned whenever
  ``s % 4 != 0``).
* Per chunk, several torch ops on the device before the launch: the rebased query offsets, the
  cumulative compressed lengths, and empty outputs.
* Warmup: the 54-key space of spec section 4, compiled one by one.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from indexer_service.kernels.specialization import (
    BLOCK_SIZE,
    ModelConfig,
)
from testkit.vllm import vllm_warmup_points


def _vllm_shaped_kernel_fn(
    query_start_ptr,  # [R+1] chunk-local query offsets q'
    seq_lens_ptr,  # [R] uncompressed sequence lengths: a view into the batch's array
    cu_seq_lens_ptr,  # [R+1]
    local_cu_seq_lens_ptr,  # [R+1], the same tensor without DCP
    token_to_seq_ptr,
    cu_seqlen_ks_ptr,
    cu_seqlen_ke_ptr,
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
        visible = first_position + 1 + (rows - q_lo)
        if COMPRESS_RATIO > 1:
            visible = visible // COMPRESS_RATIO
        if dcp_world_size > 1:
            base = ((visible // dcp_interleave) // dcp_world_size) * dcp_interleave
            remainder = visible - base * dcp_world_size
            visible = base + tl.minimum(tl.maximum(remainder - dcp_rank * dcp_interleave, 0), dcp_interleave)
        out = rows - query_slice_start
        tl.store(cu_seqlen_ks_ptr + out, tl.full([BLOCK_SIZE], 0, dtype=tl.int32) + row_start, mask=mask)
        tl.store(cu_seqlen_ke_ptr + out, row_start + visible, mask=mask)


# dcp_rank, dcp_world_size, dcp_interleave: no decode context parallelism.
DCP_OFF = (0, 1, 1)


def vllm_shaped_kernel():
    """A fresh JITFunction with Triton's default specialization of every scalar, as vLLM launches it."""
    return triton.jit(_vllm_shaped_kernel_fn)


def warmup_one_by_one(kernel, model: ModelConfig, max_num_batched_tokens: int, device: str) -> int:
    """vLLM's warmup key space, each key compiled in turn; returns the key count."""
    points = vllm_warmup_points(model, max_num_batched_tokens)
    for slice_start, slice_stop, ratio, aligned in points:
        buffers = [torch.zeros(8, dtype=torch.int32, device=device) for _ in range(7)]
        if not aligned:
            buffers[1] = buffers[1][1:]
        kernel.warmup(
            *buffers, slice_start, slice_stop, *DCP_OFF, grid=(1,), BLOCK_SIZE=BLOCK_SIZE, COMPRESS_RATIO=ratio
        )
    return len(points)


class VllmStyleBatchBuilder:
    """Builds every chunk of a plan the vLLM way, leaving the outputs on the device."""

    def __init__(self, query_start_loc: np.ndarray, seq_lens: np.ndarray, ratio: int, kernel) -> None:
        self.kernel = kernel
        self.ratio = ratio
        self.constexprs = {"BLOCK_SIZE": BLOCK_SIZE, "COMPRESS_RATIO": ratio}
        self.compressed_cpu = seq_lens.astype(np.int64) // ratio
        self.qsl = torch.from_numpy(query_start_loc.astype(np.int32)).cuda()
        self.seq_lens = torch.from_numpy(seq_lens.astype(np.int32)).cuda()
        self.compressed = self.seq_lens // ratio if ratio > 1 else self.seq_lens

    def build(self, chunks: list[tuple[int, int, int, int]]) -> list[tuple[torch.Tensor, ...]]:
        outputs = []
        for s, e, a, b in chunks:
            total = int(self.compressed_cpu[s:e].sum())
            if total == 0:
                continue
            rebased = self.qsl[s : e + 1] - self.qsl[s]
            cu = torch.zeros(e - s + 1, dtype=torch.int32, device="cuda")
            cu[1:] = torch.cumsum(self.compressed[s:e], dim=0)
            token_to_seq = torch.empty(total, dtype=torch.int32, device="cuda")
            ks = torch.empty(b - a, dtype=torch.int32, device="cuda")
            ke = torch.empty(b - a, dtype=torch.int32, device="cuda")
            outs = (token_to_seq, ks, ke)
            self.kernel[(e - s,)](rebased, self.seq_lens[s:e], cu, cu, *outs, a, b, *DCP_OFF, **self.constexprs)
            outputs.append((cu, token_to_seq, ks, ke))
        return outputs
