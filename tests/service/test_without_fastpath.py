"""Without the compiled fast path (service/compute/_fastpath not built: no C compiler at install, or a kernel-only
checkout) the service starts, says so once, reports native_fast_path off, and answers through numpy."""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest

from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.kernels.numpy_backend import build_chunk_metadata_numpy
from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
from indexer_service.service import codec
from indexer_service.service.config import load_config
from indexer_service.service.process.server import IndexerServer
from tests.golden import metadata_as_dict

EXTENSION = "indexer_service.service.compute._fastpath"
NOTICE = "serving without the compiled fast path (service/compute/_fastpath not built)"


@pytest.fixture
def no_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing the extension fails as it does where it was never built (None in sys.modules: ImportError)."""
    monkeypatch.setitem(sys.modules, EXTENSION, None)


def test_the_service_starts_and_serves_through_numpy_without_the_extension(no_extension, caplog) -> None:
    config = load_config(
        {
            "backend": "numpy",
            "warmup_target": "none",
            "native_fast_path": "true",
            "grpc_host": "127.0.0.1",
            "grpc_port": "0",
            "http_host": "127.0.0.1",
            "http_port": "0",
            "http_rpc_port": "0",
            "health_port": "0",
        },
        env={},
    )
    with caplog.at_level(logging.INFO):
        server = IndexerServer(config)
    try:
        assert [r.getMessage() for r in caplog.records].count(NOTICE) == 1
        assert any("native_fast_path=False" in r.getMessage() for r in caplog.records)
        assert server.plane.backend.build_chunk_fast is None
        inputs = ChunkInputs(np.array([0, 1, 4, 9]), np.array([20, 10, 5]), 4, 1, 3)
        answer = server.plane.call("BuildChunk", codec.chunk_inputs_to_proto(inputs).SerializeToString())
        served = codec.metadata_from_proto(pb.BuildChunkResponse.FromString(answer).metadata)
        assert metadata_as_dict(served) == metadata_as_dict(build_chunk_metadata_numpy(inputs))
    finally:
        server.grpc.stop(0)
        server.health_server.stop()
        server.http.socket.close()
        server.http_rpc.socket.close()
