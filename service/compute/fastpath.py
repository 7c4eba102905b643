"""The Python side of service/compute/fastpath.c's contract, written once: the limits it checks
(:class:`FastPathLimits`, whose fields the C file reads by name) and its call's signature (:class:`BuildChunk`).
The extension's stub, service/compute/_fastpath.pyi, types ``build_chunk`` with it;
tests/service/test_fastpath_contract.py holds the stub, the compiled module and this file equal.

Imports nothing of the service: service/overload/limits.py builds the limits from the configuration,
service/compute/backends.py loads the extension.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol


class FastPathLimits(NamedTuple):
    """The limits service/compute/fastpath.c checks: :meth:`RequestLimits.check_request`'s and
    :meth:`RequestLimits.check_sizes`' (service/overload/limits.py). A request over any of them steps aside to the
    general path, which names the limit."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    workspace_tokens: int  # max_model_len * WORKSPACE_TOKENS_PER_MODEL_LEN: the KV workspace at ratio 1
    max_message_bytes: int
    chunk_overhead_bytes: int  # a chunk's bytes besides its arrays (limits.CHUNK_OVERHEAD_BYTES)


# (serialized BuildChunkResponse, requests, query rows, seconds spent writing the arrays)
FastPathAnswer = tuple[bytes, int, int, float]


class BuildChunk(Protocol):
    """``build_chunk(request, limits, admitted_ratios, admit=None)``: serve one serialized BuildChunkRequest, or
    None when it is not the common case the C code proves valid (any error, DCP, a limit reached, an unusual
    encoding): the caller then takes the general path.

    ``admitted_ratios``: the normalised compress ratios strict mode admits, or None for any.
    ``admit(estimate, answer_bytes)``: called once the request is valid and within the limits, before any array is
    written, with the general path's upper bound of the response's bytes (RequestLimits.check_sizes': what the
    heavy lane is decided on) and the response's exact size (what the response budget holds); it reserves or
    raises, and from then on the call never steps aside.
    """

    def __call__(
        self,
        request: bytes,
        limits: FastPathLimits,
        admitted_ratios: tuple[int, ...] | None,
        admit: Callable[[int, int], None] | None = None,
        /,
    ) -> FastPathAnswer | None: ...
