"""A numpy array handed to Triton where it would take a CPU torch tensor: the kernel's arguments wherever nothing runs
on a GPU (the ahead-of-time warmup, its proof through Triton's interpreter, the CPU builder in tests).

Why not torch: on a machine without a GPU nothing else needs it, and importing it is most of a CPU server's start
(seconds, ahead of readiness). Triton reads a pointer argument through a small part of torch's tensor interface,
which :class:`HostTensor` gives for one contiguous numpy buffer:

- binding and specialization (any Triton): ``data_ptr()`` (the alignment class) and ``dtype`` (Triton spells it as
  ``str(dtype).split(".")[-1]``: a numpy dtype's name, ``int32``, is torch's too);
- the interpreter: ``untyped_storage()`` (with its ``data_ptr()``, ``cpu()`` and ``copy_()``), ``storage_offset()``,
  ``size()``, ``stride()``, ``new_empty()`` and ``set_()``, through which it makes a host view of each argument and
  copies it back after the launch. Here the memory is already the host's: the view is of the same buffer and the copy
  back is to itself, so the kernel's writes land in the caller's array.

tests/kernels/test_host_tensor.py holds Triton's specialization of a HostTensor to that of the torch tensor it stands
for, and an interpreted launch on HostTensors to numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

# Triton's aligned pointer class: a pointer at a multiple of this many bytes (torch's own allocations are).
ALIGNMENT = 16


def aligned_empty(shape: int | tuple[int, ...], dtype: DTypeLike = np.int32) -> np.ndarray:
    """An uninitialised C-contiguous array starting at a multiple of :data:`ALIGNMENT` bytes, whatever the allocator
    gives: the pointer class Triton specializes on, as a fresh torch tensor has it."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    raw = np.empty(count + ALIGNMENT // dtype.itemsize, dtype=dtype)  # any allocator aligns to the item's size
    skip = (-raw.ctypes.data % ALIGNMENT) // dtype.itemsize
    return raw[skip : skip + count].reshape(shape)


class HostStorage:
    """The buffer a :class:`HostTensor` views (torch's untyped storage), one-dimensional."""

    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer = buffer

    def data_ptr(self) -> int:
        return self.buffer.ctypes.data

    def cpu(self) -> HostStorage:
        return self  # already the host's memory

    def copy_(self, source: HostStorage) -> HostStorage:
        if source.data_ptr() != self.data_ptr():
            np.copyto(self.buffer, source.buffer.view(self.buffer.dtype))
        return self


class HostTensor:
    """``array`` (C-contiguous, or a slice of a contiguous one) as Triton sees a CPU tensor; writes through it land in
    ``array``."""

    def __init__(self, array: np.ndarray, storage: HostStorage | None = None) -> None:
        if storage is None:
            root = array
            while isinstance(root.base, np.ndarray):
                root = root.base
            if not root.flags.c_contiguous:
                raise ValueError("a HostTensor views a contiguous buffer")
            storage = HostStorage(root.reshape(-1))
        self.array = array
        self._storage = storage

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> HostStorage:
        return self._storage

    def storage_offset(self) -> int:
        return (self.data_ptr() - self._storage.data_ptr()) // self.array.itemsize

    def size(self) -> tuple[int, ...]:
        return self.array.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(step // self.array.itemsize for step in self.array.strides)

    def new_empty(self, size: int | Sequence[int], device: str = "cpu") -> HostTensor:
        return HostTensor(np.empty(size, dtype=self.array.dtype))

    def set_(self, storage: HostStorage, offset: int, size: Sequence[int], stride: Sequence[int]) -> HostTensor:
        """This tensor made a view of ``storage`` (torch's ``Tensor.set_``)."""
        itemsize = self.array.itemsize
        start = storage.buffer.view(self.array.dtype)[offset:]
        self.array = np.lib.stride_tricks.as_strided(
            start, shape=tuple(size), strides=tuple(step * itemsize for step in stride), writeable=True
        )
        self._storage = storage
        return self

    def cpu(self) -> HostTensor:
        return self

    def numpy(self) -> np.ndarray:
        return self.array

    def __repr__(self) -> str:
        return f"HostTensor({self.array!r})"
