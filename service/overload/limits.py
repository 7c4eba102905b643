"""What one request may ask for, checked before any work: its limits (RESOURCE_EXHAUSTED) and this server's
policy (FAILED_PRECONDITION), after the kernel layer has found it well formed (INVALID_ARGUMENT).

The load-dependent side of admission (the response budget, the heavy lane) is service/overload/admission.py; the same
limits in C are service/compute/fastpath.c's, which takes them from :func:`fast_path_limits` (a
service/compute/fastpath.py FastPathLimits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from indexer_service.kernels.inputs import (
    ChunkHostPart,
    ChunkInputs,
    ValidBatch,
    validate_request,
)
from indexer_service.kernels.planner import WORKSPACE_TOKENS_PER_MODEL_LEN, BatchInputs, prefill_workspace_size
from indexer_service.kernels.specialization import CompileKey
from indexer_service.service.compute.fastpath import FastPathLimits
from indexer_service.service.compute.warmup import Warmup
from indexer_service.service.config import ServiceConfig
from indexer_service.service.errors import LimitExceeded, PolicyRefused

# Upper bound of a ChunkMetadata's (and its ChunkSpec's) bytes besides the arrays: tags, lengths, scalars.
CHUNK_OVERHEAD_BYTES = 512


def max_request_bytes(config: ServiceConfig) -> int:
    """The largest request message either transport accepts: what a valid request at the configured limits can
    take (two int32 arrays of max_num_seqs + 1 elements and a few scalars), with room for other encodings.
    Anything larger is refused before it is read whole, so queued requests cannot fill memory."""
    return min(config.max_message_bytes, 64 * 2**10 + 32 * (config.max_num_seqs + 1))


def fast_path_limits(config: ServiceConfig) -> FastPathLimits:
    """The limits service/compute/fastpath.c checks, from the configuration: the same as :class:`RequestLimits`'."""
    return FastPathLimits(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        workspace_tokens=config.max_model_len * WORKSPACE_TOKENS_PER_MODEL_LEN,
        max_message_bytes=config.max_message_bytes,
        chunk_overhead_bytes=CHUNK_OVERHEAD_BYTES,
    )


def launch_admission(warmup: Warmup) -> Callable[[CompileKey], None]:
    """Strict mode's check: a launch whose kernel variant is outside the warmed set is refused, not compiled."""

    def admit(key: CompileKey) -> None:
        if key not in warmup.compiled_keys():
            raise PolicyRefused(
                f"compress_ratio: kernel variant {key.label()} is not in the warmed set and strict mode "
                "refuses to compile after ready"
            )

    return admit


def strict_admission(config: ServiceConfig, warmup: Warmup) -> Callable[[CompileKey], None] | None:
    """Strict mode's :func:`launch_admission` when ``config.strict``, else None. Built once per server
    (service/process/server.py) and handed to both that check it: the backend (each real launch) and the data plane
    (:class:`RequestLimits`, before any work; the fast path's admitted ratios)."""
    return launch_admission(warmup) if config.strict else None


def _at(field: str, index: int | None = None) -> str:
    return field if index is None else f"{field}[{index}]"


class RequestLimits:
    """The configured limits and policy one request is checked against. ``admit_launch`` is strict mode's
    :func:`launch_admission` (None: any kernel variant may compile). ``warmup_set``: the model's kernel variants;
    ``on_miss(key)`` hears each request whose variant is outside it (None: nobody listens)."""

    def __init__(
        self,
        config: ServiceConfig,
        admit_launch: Callable[[CompileKey], None] | None,
        warmup_set: frozenset[CompileKey] = frozenset(),
        on_miss: Callable[[CompileKey], None] | None = None,
    ) -> None:
        self.config = config
        self.admit_launch = admit_launch
        self.warmup_set = warmup_set
        self.on_miss = on_miss

    def check_request(self, inputs: ChunkInputs | BatchInputs) -> ValidBatch:
        """Malformed input first (INVALID_ARGUMENT), then limits (RESOURCE_EXHAUSTED), then policy
        (FAILED_PRECONDITION), all before any work: a request is named malformed before a limit or a policy
        speaks about values that mean nothing. The kernel layer checks the rest of the shape (chunk bounds). The
        validated batch is what the request's later steps use."""
        config = self.config
        valid = validate_request(inputs.query_start_loc, inputs.seq_lens, inputs.compress_ratio, inputs.dcp)
        qsl, seq, ratio = valid.query_start_loc, valid.seq_lens, valid.ratio
        if seq.size > config.max_num_seqs:
            raise LimitExceeded(f"seq_lens: {seq.size} sequences, above max_num_seqs {config.max_num_seqs}")
        if (qsl > config.max_num_batched_tokens).any():
            i = int(np.argmax(qsl > config.max_num_batched_tokens))
            raise LimitExceeded(
                f"{_at('query_start_loc', i)}: {qsl[i]} query tokens, above max_num_batched_tokens "
                f"{config.max_num_batched_tokens}"
            )
        if (seq > config.max_model_len).any():
            i = int(np.argmax(seq > config.max_model_len))
            raise LimitExceeded(f"{_at('seq_lens', i)}: {seq[i]} tokens, above max_model_len {config.max_model_len}")
        if inputs.dcp.world_size > 1 and ratio > 1:
            raise PolicyRefused(
                f"dcp_world_size: DCP (world size {inputs.dcp.world_size}) with compress ratio {ratio} is "
                "not supported: no engine shards compressed KV across DCP ranks (vLLM's builder rejects it); "
                "DCP is supported at compress ratio 0 or 1"
            )
        # Service-owned buffers are always aligned and scalars validated to int32, so the ratio alone decides the
        # variant, on either backend; the Triton backend checks each real launch again.
        key = CompileKey(compress_ratio=ratio)
        if self.on_miss is not None and key not in self.warmup_set:
            self.on_miss(key)
        if self.admit_launch is not None:
            self.admit_launch(key)
        return valid

    def check_plan_model_len(self, batch: BatchInputs) -> None:
        """A PlanBatch's own max_model_len may not pass the server's (it sizes the workspace of each chunk)."""
        if batch.max_model_len > self.config.max_model_len:
            raise LimitExceeded(
                f"max_model_len: {batch.max_model_len}, above the server's max_model_len {self.config.max_model_len}"
            )

    def check_sizes(
        self, chunks: Sequence[ChunkInputs], hosts: Sequence[ChunkHostPart | None], omit_token_to_seq: bool
    ) -> int:
        """The response's size (an upper bound), after the limits on the workspace and max_message_bytes."""
        config = self.config
        response_bytes = CHUNK_OVERHEAD_BYTES * len(chunks)
        for inputs, host in zip(chunks, hosts, strict=True):
            if host is None:
                continue
            workspace = prefill_workspace_size(config.max_model_len, host.ratio)
            if host.total > workspace:
                over = inputs.req_start + int(np.searchsorted(host.cu_seq_lens, workspace, side="right")) - 1
                raise LimitExceeded(
                    f"{_at('seq_lens', over)}: the chunk's compressed tokens reach {host.total}, above the KV "
                    f"workspace of {workspace} (max_model_len {config.max_model_len} * 40 / compress ratio "
                    f"{host.ratio})"
                )
            a, b = host.query_slice
            response_bytes += 8 * (b - a) + 8 * host.cu_seq_lens.size + (0 if omit_token_to_seq else 4 * host.total)
        if response_bytes > config.max_message_bytes:
            advice = "send a smaller batch" if omit_token_to_seq else "set omit_token_to_seq or send a smaller batch"
            raise LimitExceeded(
                f"response: about {response_bytes} bytes, above max_message_bytes {config.max_message_bytes}; {advice}"
            )
        return response_bytes
