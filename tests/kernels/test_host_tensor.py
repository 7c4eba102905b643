"""kernels/host_tensor.py: a numpy array as Triton takes a CPU torch tensor. Triton specializes it as it does the torch
tensor it stands for, and its interpreter launches on it, writing into the array."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from triton.runtime.jit import mangle_type

from indexer_service.kernels import triton_adapter
from indexer_service.kernels.host_tensor import ALIGNMENT, HostTensor, aligned_empty
from indexer_service.kernels.inputs import ChunkInputs, DcpConfig, chunk_host_part
from indexer_service.kernels.numpy_backend import chunk_arrays_numpy
from indexer_service.kernels.triton_launcher import TritonChunkBuilder


@pytest.mark.parametrize("shape", [1, 8, 13, (3, 7)])
def test_aligned_buffers_start_on_tritons_aligned_pointer_class(shape) -> None:
    for _ in range(20):
        array = aligned_empty(shape)
        assert array.ctypes.data % ALIGNMENT == 0 and array.flags.c_contiguous
        assert array.shape == ((shape,) if isinstance(shape, int) else shape) and array.dtype == np.int32


@pytest.mark.parametrize("offset", [0, 1, 4])
def test_triton_specializes_a_host_tensor_as_the_torch_tensor_it_stands_for(offset: int) -> None:
    """The type (``*i32``) and the alignment class (``D`` at a multiple of 16 bytes, none one element in) of a
    HostTensor are those of a torch tensor at the same offset from an aligned start."""
    host = HostTensor(aligned_empty(16)[offset:])
    device = torch.zeros(16, dtype=torch.int32)[offset:]
    assert mangle_type(host) == mangle_type(device) == "*i32"
    assert mangle_type(host, True) == mangle_type(device, True)
    assert (host.data_ptr() % ALIGNMENT == 0) == (offset % 4 == 0)


def test_the_storage_interface_views_the_same_memory() -> None:
    """What Triton's interpreter does with an argument: a host view of its storage at its offset, written through,
    then copied back to the storage it came from: the writes land in the caller's array."""
    base = aligned_empty(12)
    base.fill(0)
    arg = HostTensor(base[4:10])
    storage = arg.untyped_storage()
    assert storage.cpu() is storage and storage.data_ptr() == base.ctypes.data
    assert arg.storage_offset() == 4 and arg.size() == (6,) and arg.stride() == (1,)
    view = arg.new_empty(0, device="cpu").set_(storage.cpu(), arg.storage_offset(), arg.size(), arg.stride())
    view.numpy()[:] = np.arange(6)
    storage.copy_(view.untyped_storage())
    assert base.tolist() == [0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 0, 0]
    table = HostTensor(aligned_empty((3, 7)))
    assert table.stride() == (7, 1) and table.shape == (3, 7) and table.storage_offset() == 0
    other = aligned_empty(12)
    other.fill(7)
    storage.copy_(HostTensor(other).untyped_storage())  # another buffer: copied
    assert base.tolist() == [7] * 12


@pytest.mark.parametrize("dcp", [DcpConfig(), DcpConfig(rank=1, world_size=2)], ids=["nodcp", "dcp2r1"])
def test_the_interpreter_launches_on_host_tensors_as_numpy_computes(triton_cpu, dcp: DcpConfig) -> None:
    """The CPU builder launches on host tensors (no torch): its arrays equal numpy's."""
    inputs = ChunkInputs(np.array([0, 3, 9, 9, 14]), np.array([17, 40, 8, 300]), 4, 0, 4, dcp=dcp)
    host = chunk_host_part(inputs)
    builder = TritonChunkBuilder("cpu", kernel=triton_cpu.kernel, combine=False, poison=-7)
    got, expected = builder.arrays(host, dcp), chunk_arrays_numpy(host, dcp)
    assert all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True))


def test_an_import_is_refused_in_the_refusing_thread_only() -> None:
    """triton_adapter's refusal (how Triton's binder is set up without torch) fails the import in its own thread and
    lets every other thread import as usual; gone after the block."""
    name = "json.tool"  # a module this process has not imported
    assert name not in __import__("sys").modules
    seen: dict[str, object] = {}
    with triton_adapter.refused_in_this_thread(name):
        with pytest.raises(ModuleNotFoundError, match="kept out"):
            __import__(name)
        other = threading.Thread(target=lambda: seen.update(module=__import__(name)))
        other.start()
        other.join()
    assert seen["module"] is not None
    __import__(name)
