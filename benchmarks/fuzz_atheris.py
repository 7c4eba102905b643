"""Coverage-guided fuzzing of the request path with atheris (libFuzzer), in process.

    python -m benchmarks.fuzz_atheris [-runs=N] [-max_total_time=S] [CORPUS_DIR ...]   (any libFuzzer flag)

Each input drives the data plane that every transport shares (``DataPlane.call``, numpy backend, the fuzz
tests' limits): half of the inputs are parsed as a serialized request (raw bytes; the ones protobuf cannot
parse are gRPC's business, not the service's), the other half feed testkit/fuzzing.py's generator through
atheris' integer source, so libFuzzer's coverage feedback steers both the bytes and the structure. Every answer
is judged by the same oracle as the hypothesis tests and the soak: numpy's result, or a refusal whose code the
request justifies and whose message names a field. A wrong answer or any exception other than the service's
own error is a crash: libFuzzer stops, prints it, and saves the input as ``crash-<sha1>``.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["indexer_service", "testkit.fuzzing"]):
    import grpc
    from google.protobuf.message import DecodeError

    from indexer_service.service.config import load_config
    from indexer_service.service.dataplane import DataPlane
    from indexer_service.service.errors import ServiceError
    from indexer_service.service.transport.grpc_calls import GRPC_STATUS
    from testkit import planes
    from testkit.fuzzing import (
        FUZZ_LIMITS,
        REQUEST_TYPES,
        REQUESTS,
        RESPONSE_TYPES,
        check_answer,
        describe,
        judge,
    )

METHODS = tuple(REQUEST_TYPES)


def make_plane() -> DataPlane:
    """The server's data plane with the fuzz tests' limits, numpy backend, no warmup, ready."""
    limits = FUZZ_LIMITS
    config = load_config(
        {
            "backend": "numpy",
            "warmup_target": "none",
            "max_num_seqs": limits.max_num_seqs,
            "max_num_batched_tokens": limits.max_num_batched_tokens,
            "max_model_len": limits.max_model_len,
            "max_message_bytes": limits.max_message_bytes,
            "max_logits_bytes": limits.max_logits_bytes,
            "max_plan_chunks": limits.max_plan_chunks,
        },
        env={},
    )
    plane = planes.make_plane(config)
    plane.readiness.refresh()
    return plane


PLANE = make_plane()


def one_input(data: bytes) -> None:
    source = atheris.FuzzedDataProvider(data)
    method = METHODS[source.ConsumeIntInRange(0, len(METHODS) - 1)]
    if source.ConsumeBool():
        try:
            request = REQUEST_TYPES[method].FromString(source.ConsumeBytes(source.remaining_bytes()))
        except DecodeError:
            return
    else:
        request = REQUESTS[method](source.ConsumeIntInRange, FUZZ_LIMITS)
    verdict = judge(method, request, FUZZ_LIMITS)
    try:
        response = RESPONSE_TYPES[method].FromString(PLANE.call(method, request))
        code, details = grpc.StatusCode.OK, ""
    except ServiceError as exc:
        response, code, details = None, GRPC_STATUS[exc.code], exc.message
    problems = check_answer(verdict, request, code, details, response)
    if problems:
        raise AssertionError(f"{method} {describe(request)}: {'; '.join(problems)}")


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
