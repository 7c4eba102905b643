"""The warmup proves each variant: after a key compiles, one launch on a tiny input is checked against numpy.

A deliberately wrong variant (the kernel's own source with ``ke + 1`` stored) is injected through the seam the compile
engine and the builder read at call time, the kernel in ``kernels.triton_kernel``: no flag in the service. It
fails its key with the first wrong index in the message and keeps a real server process not ready, on CPU (the
ahead-of-time warmup proves through Triton's interpreter) and on a CUDA GPU (the in-process warmup proves on the
device; skipped without one).
"""

from __future__ import annotations

import inspect
import json
import linecache
import sys
import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest
import triton

from indexer_service.client import IndexerClient
from indexer_service.kernels import triton_kernel
from indexer_service.kernels.compile_engine import (
    PROOF_SENTINEL,
    ProofUnavailableError,
    compile_keys,
    first_difference,
    proof_inputs,
    prove_key,
)
from indexer_service.kernels.inputs import chunk_host_part
from indexer_service.kernels.numpy_backend import chunk_arrays_numpy
from indexer_service.kernels.specialization import CompileKey, ModelConfig, warmup_keys
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from testkit.harness import ServiceProcess, clean_env, http_get, listen_flags
from tests.conftest import cuda_available

# The defect: every ``ke`` one too large. Made from the kernel's own source, so the wrong kernel is the real one
# with this one change, whatever else the real one becomes.
KE_STORE = "tl.store(cu_seqlen_ke_ptr + rows, row_start + visible, mask=mask)"
WRONG_KE_STORE = "tl.store(cu_seqlen_ke_ptr + rows, row_start + visible + 1, mask=mask)"
# Triton reads a kernel's source through inspect, which finds it for a file name linecache holds.
WRONG_KERNEL_FILE = "<the service's kernel with ke + 1>"


def wrong_kernel_fn() -> Callable:
    """The service's kernel function with KE_STORE replaced by WRONG_KE_STORE, in a copy of its module's globals."""
    source = inspect.getsource(triton_kernel._build_prefill_metadata_kernel_fn)
    assert source.count(KE_STORE) == 1, f"the kernel no longer stores ke as {KE_STORE!r}: update the defect"
    source = source.replace(KE_STORE, WRONG_KE_STORE)
    linecache.cache[WRONG_KERNEL_FILE] = (len(source), None, source.splitlines(keepends=True), WRONG_KERNEL_FILE)
    namespace = dict(vars(triton_kernel))
    exec(compile(source, WRONG_KERNEL_FILE, "exec"), namespace)
    return namespace["_build_prefill_metadata_kernel_fn"]


def inject_wrong_kernel(target) -> None:
    """Swap the kernel every launch and compile reads (``target``: the module, or pytest's monkeypatch)."""
    wrong_fn = wrong_kernel_fn()
    wrong = triton.jit(wrong_fn, **triton_kernel.KERNEL_JIT_OPTIONS)
    if hasattr(target, "setattr"):
        target.setattr(triton_kernel, "_build_prefill_metadata_kernel_fn", wrong_fn)
        target.setattr(triton_kernel, "_build_prefill_metadata_kernel", wrong)
    else:
        target._build_prefill_metadata_kernel_fn = wrong_fn
        target._build_prefill_metadata_kernel = wrong


def serve_with_wrong_kernel() -> None:
    """``python -c 'from tests.service.test_warmup_proof import serve_with_wrong_kernel as s; s()' serve ...``: the real
    CLI, with the wrong kernel injected first."""
    from indexer_service.service.process.cli import main

    inject_wrong_kernel(triton_kernel)
    sys.exit(main(sys.argv[1:]))


def _interpreter_or_skip(key: CompileKey) -> str | None:
    try:
        return prove_key(key, on_gpu=False)
    except ProofUnavailableError as exc:
        pytest.skip(str(exc))


def test_proof_inputs_have_compressed_tokens_and_rows_at_every_ratio() -> None:
    for ratio in (1, 4, 128, 1024, 2**20):
        host = chunk_host_part(proof_inputs(ratio))
        assert host is not None and host.total > 0
        token_to_seq, ks, ke = chunk_arrays_numpy(host, proof_inputs(ratio).dcp)
        assert ke.size == 9 and (ke > ks).any() and len(set(token_to_seq.tolist())) == 4


def test_first_difference_names_the_array_and_the_first_wrong_index() -> None:
    good = (np.arange(3), np.zeros(4, np.int32), np.array([1, 2, 3, 4]))
    assert first_difference(good, good) is None
    bad = (good[0], good[1], np.array([1, 2, 9, 9]))
    assert first_difference(bad, good) == "cu_seqlen_ke[2] = 9, numpy gives 3 (2 of 4 elements wrong)"
    unwritten = (good[0], np.full(4, PROOF_SENTINEL), good[2])
    assert first_difference(unwritten, good).startswith(f"cu_seqlen_ks[0] = {PROOF_SENTINEL}, numpy gives 0")


@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_the_real_kernel_passes_its_proof_in_the_interpreter(ratio: int) -> None:
    assert _interpreter_or_skip(CompileKey(ratio)) is None


def test_a_wrong_kernel_fails_its_proof_with_the_first_wrong_index(monkeypatch) -> None:
    inject_wrong_kernel(monkeypatch)
    message = _interpreter_or_skip(CompileKey(4))
    assert message is not None
    assert message.startswith("proof launch on Triton's interpreter disagrees with numpy: cu_seqlen_ke[0] = ")
    assert "(9 of 9 elements wrong)" in message


def test_aot_warmup_of_a_wrong_kernel_fails_every_key_naming_the_element(monkeypatch, tmp_path) -> None:
    """compile_keys ahead of time (no GPU): the wrong kernel compiles, then its interpreted proof fails it."""
    _interpreter_or_skip(CompileKey(1))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    inject_wrong_kernel(monkeypatch)
    keys = warmup_keys(ModelConfig((4,), index_kpool=4))
    seen = []
    (outcome,) = compile_keys(keys, keys, target="cuda:90", progress=lambda *a: seen.append(a))
    assert not outcome.ok
    assert outcome.error.startswith("compiled, but proof launch on Triton's interpreter disagrees with numpy: ")
    assert "cu_seqlen_ke[0] = " in outcome.error
    assert outcome.seconds > 0 and [(d, t) for d, t, _ in seen] == [(1, 1)]
    assert list((tmp_path / "cache").rglob("*.cubin")), "the wrong kernel must have compiled: the proof caught it"


def _assert_never_ready(server: ServiceProcess) -> pb.GetWarmupStatusResponse:
    with IndexerClient(server.address, health_check=False) as client:
        for _ in range(1200):  # the warmup runs in the background: wait until it has concluded
            status = client.warmup_status(timeout=10)
            if status.state != pb.WARMUP_STATE_RUNNING:
                break
            time.sleep(0.1)
        with pytest.raises(grpc.RpcError) as refused:
            client.build_chunk(proof_inputs(4), timeout=10)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert status.state == pb.WARMUP_STATE_FAILED and not status.ready
    assert http_get(f"{server.http_url}/readyz")[0] == 503
    assert status.keys and all(k.state == pb.KEY_STATE_FAILED for k in status.keys)
    for key in status.keys:
        assert "disagrees with numpy: cu_seqlen_ke[0] = " in key.error, key.error
    log = server.log()
    assert "warmup failed failed=" in log and "cu_seqlen_ke[0]" in log
    return status


def _wrong_kernel_server(tmp_path, *flags: str) -> ServiceProcess:
    code = "from tests.service.test_warmup_proof import serve_with_wrong_kernel as s; s()"
    command = [
        sys.executable,
        "-c",
        code,
        "serve",
        *listen_flags(),
    ]
    env = clean_env(TRITON_CACHE_DIR=str(tmp_path / "cache"))
    return ServiceProcess(*flags, workdir=tmp_path, command=command, env=env)


@pytest.mark.slow
def test_a_wrong_variant_keeps_a_real_cpu_server_not_ready(tmp_path) -> None:
    """A real server process, numpy backend, ahead-of-time warmup for cuda:90: compiled, proved wrong, not
    ready. One ratio keeps it to one compile."""
    _interpreter_or_skip(CompileKey(1))
    model = tmp_path / "config.json"
    model.write_text(json.dumps({"compress_ratios": [4], "index_kpool": 4}))
    server = _wrong_kernel_server(
        tmp_path, "--backend", "numpy", "--warmup-target", "cuda:90", "--model-config", str(model)
    )
    try:
        status = _assert_never_ready(server.start().wait_listening())
        assert (status.backend, status.target) == ("numpy", "cuda:90")
        assert [k.label for k in status.keys] == [CompileKey(4).label()]
    finally:
        server.kill()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
def test_a_wrong_variant_keeps_a_real_gpu_server_not_ready(tmp_path) -> None:
    """The default config on a CUDA machine (auto, in-process warmup): the proof launch on the device fails every
    key; the auto crossover is never measured."""
    server = _wrong_kernel_server(tmp_path)
    try:
        status = _assert_never_ready(server.start().wait_listening())
        assert (status.backend, status.target) == ("auto", "in-process")
        assert len(status.keys) == 3 and status.auto_crossover_elements == 0
        assert all("proof launch on cuda:" in k.error for k in status.keys)
    finally:
        server.kill()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU")
def test_in_process_proof_on_the_gpu(monkeypatch) -> None:
    """The real kernel passes its device proof for every key; the wrong one fails with the first wrong index."""
    keys = warmup_keys(ModelConfig((0, 4, 128)))
    assert all(o.ok for o in compile_keys(keys, keys, target=None, workers=2)), "the real kernel must pass"
    inject_wrong_kernel(monkeypatch)
    outcomes = compile_keys(keys, keys, target=None, workers=2)
    assert not any(o.ok for o in outcomes)
    assert all("proof launch on cuda:" in o.error and "cu_seqlen_ke[0] = " in o.error for o in outcomes), outcomes
