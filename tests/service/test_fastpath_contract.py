"""service/compute/fastpath.c's contract held to its one Python definition (service/compute/fastpath.py): the limits'
fields are the names the C file reads, the call's signature is the one the stub types it with, and the stub
(service/compute/_fastpath.pyi) names exactly what the compiled module exports."""

from __future__ import annotations

import ast
import inspect

import numpy as np
import pytest

from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.service import codec
from indexer_service.service.compute.fastpath import BuildChunk, FastPathLimits
from indexer_service.service.config import load_config
from indexer_service.service.overload.limits import fast_path_limits
from testkit.paths import REPO

_fastpath = pytest.importorskip(
    "indexer_service.service.compute._fastpath", reason="service/compute/_fastpath is not built"
)

STUB = REPO / "service" / "compute" / "_fastpath.pyi"


def _stub_names() -> set[str]:
    """The stub's top-level functions and annotated names."""
    names = set()
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_the_stub_names_what_the_compiled_module_exports():
    exported = {name for name in vars(_fastpath) if not name.startswith("_")}
    assert _stub_names() == exported


def test_the_limits_fields_are_what_fastpath_c_reads():
    assert FastPathLimits._fields == _fastpath.limit_fields


def test_build_chunk_has_the_signature_service_fastpath_py_writes():
    written = inspect.signature(BuildChunk.__call__)
    compiled = inspect.signature(_fastpath.build_chunk)
    assert [(p.name, p.kind, p.default) for p in compiled.parameters.values()] == [
        (p.name, p.kind, p.default)
        for p in list(written.parameters.values())[1:]  # without self
    ]


def test_limits_are_read_by_name_not_by_position():
    """A limits object in another field order answers the same; one missing a field is refused, naming it."""
    limits = fast_path_limits(load_config({"warmup_target": "none"}, env={}))
    data = codec.chunk_inputs_to_proto(ChunkInputs(np.array([0, 1, 4, 9]), np.array([20, 10, 5]), 4, 1, 3))
    data = data.SerializeToString()
    expected = _fastpath.build_chunk(data, limits, None)
    assert expected is not None

    class Reordered:
        pass

    reordered = Reordered()
    for name, value in reversed(list(limits._asdict().items())):
        setattr(reordered, name, value)
    assert _fastpath.build_chunk(data, reordered, None)[0] == expected[0]

    del reordered.workspace_tokens
    with pytest.raises(AttributeError, match="workspace_tokens"):
        _fastpath.build_chunk(data, reordered, None)
    with pytest.raises(AttributeError):
        _fastpath.build_chunk(data, tuple(limits), None)  # a bare tuple has no names: no silent positional read


def test_a_remembered_limits_object_never_answers_for_another():
    """The C code remembers the last FastPathLimits it read: each call still follows its own limits object."""
    limits = fast_path_limits(load_config({"warmup_target": "none"}, env={}))
    tight = limits._replace(max_num_seqs=2)  # the request below has 3 sequences: over it, so the call steps aside
    data = codec.chunk_inputs_to_proto(ChunkInputs(np.array([0, 1, 4, 9]), np.array([20, 10, 5]), 4, 1, 3))
    data = data.SerializeToString()
    for _ in range(2):
        assert _fastpath.build_chunk(data, limits, None) is not None
        assert _fastpath.build_chunk(data, tight, None) is None
