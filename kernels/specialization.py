"""Which compiled variants of the chunk-metadata kernel exist, which ones warmup compiles, which one a
live launch needs.

Two code paths that normalise the compress ratio differently (the runtime ``max(1, r)``, the warmup the raw
``0``) would warm variants no launch needs and ask Triton to compile a division by zero, which no backend can be
relied on to refuse (docs/spec.md, section 10). Here exactly one function, :func:`normalize_compress_ratio`, turns
a configured ratio into the constexpr ``COMPRESS_RATIO``; :func:`warmup_keys` and :func:`key_for_launch` both go
through it, so a ``0`` can never reach a key or a launch.

Specialization axes, chosen on purpose (see ``kernels/triton_kernel.py`` for the kernel):

* ``COMPRESS_RATIO`` and ``BLOCK_SIZE`` are constexprs: the ratio is a division the compiler turns into
  a shift, worth a variant per ratio.
* The query slice is not an argument at all: it is folded into the per-request program table the host
  writes (vLLM passes it as two scalars, whose 1 / divisible-by-16 / generic classes make 9 variants).
* The three DCP scalars only pick a branch and bound a min/max; Triton would specialize each on ``== 1``
  and ``% 16 == 0``. They are ``do_not_specialize``; what is left is their integer width, which
  validation pins to i32.
* Pointers would specialize on 16-byte alignment. The service allocates every buffer it passes and
  starts every segment of a shared buffer on a 16-byte boundary, so only the aligned class is reachable
  and warmed (vLLM passes ``seq_lens[s:e]``, a view that is unaligned whenever ``s % 4 != 0``).

So the warmup set is one key per normalised ratio, and every reachable key is in it
(``tests/kernels/test_specialization.py`` checks both directions).
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

BLOCK_SIZE = 1024
POINTER_ALIGNMENT = 16

# Argument order of the kernel: see kernels/triton_kernel.py.
POINTER_ARGS = ("program_table", "token_to_seq", "cu_seqlen_ks", "cu_seqlen_ke")
SCALAR_ARGS = ("dcp_rank", "dcp_world_size", "dcp_interleave")

_I32 = (-(2**31), 2**31)
_I64 = (-(2**63), 2**63)
_U64 = (0, 2**64)


def normalize_compress_ratio(ratio: object) -> int:
    """The one place a configured compress ratio becomes the kernel's ``COMPRESS_RATIO``.

    ``0`` is how DeepSeek-V4 configs mark an uncompressed (sliding-window-only) layer: it means 1.
    Negative or non-integer values are invalid.
    """
    if isinstance(ratio, bool):
        raise ValueError(f"compress ratio must be an integer, got {ratio!r}")
    try:
        value = operator.index(ratio)
    except TypeError:
        raise ValueError(f"compress ratio must be an integer, got {ratio!r}") from None
    if value < 0:
        raise ValueError(f"compress ratio must be >= 0 (0 means uncompressed), got {value}")
    return max(1, value)


def triton_int_type(value: int) -> str:
    """The integer type Triton gives a Python int argument (a ``do_not_specialize`` scalar keeps only this)."""
    if _I32[0] <= value < _I32[1]:
        return "i32"
    if _I64[0] <= value < _I64[1]:
        return "i64"
    if _U64[0] <= value < _U64[1]:
        return "u64"
    raise OverflowError(f"integer argument {value} does not fit 64 bits")


def triton_int_specialization_class(value: int) -> int:
    """Triton's class for an integer it *does* specialize: 1, divisible by 16, or generic, per width.

    Names the variants a kernel with specialized scalars compiles: the vLLM-style key space the warmup
    benchmark compares against (``benchmarks/vllm_baseline.py``); the service's own kernel specializes none.
    """
    if value == 1:
        return 1
    divisible = value % 16 == 0
    width = triton_int_type(value)
    if width == "i32":
        return 16 if divisible else 2
    if width == "i64":
        return 2**31 if divisible else 2**31 + 1
    return 2**63 if divisible else 2**63 + 1


def pointer_class(address: int) -> int:
    """Triton specializes a pointer on whether its address is 16-byte aligned."""
    return POINTER_ALIGNMENT if address % POINTER_ALIGNMENT == 0 else 1


@dataclass(frozen=True, order=True)
class CompileKey:
    """One compiled variant of the kernel: every axis Triton specializes it on."""

    compress_ratio: int
    block_size: int = BLOCK_SIZE
    pointer_classes: tuple[int, ...] = field(default=(POINTER_ALIGNMENT,) * len(POINTER_ARGS))
    scalar_types: tuple[str, ...] = field(default=("i32",) * len(SCALAR_ARGS))

    def __post_init__(self) -> None:
        if self.compress_ratio < 1:
            raise ValueError(
                f"CompileKey.compress_ratio must be normalised (>= 1), got {self.compress_ratio}; "
                "use normalize_compress_ratio"
            )

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    def label(self) -> str:
        """Short, bounded-cardinality name for logs and metric labels."""
        aligned = all(c == POINTER_ALIGNMENT for c in self.pointer_classes)
        widths = "-".join(sorted(set(self.scalar_types)))
        return f"r{self.compress_ratio}-b{self.block_size}-{'aligned' if aligned else 'unaligned'}-{widths}"


@dataclass(frozen=True)
class ModelConfig:
    """The parts of a model config that decide the kernel's variants."""

    compress_ratios: tuple[int, ...] = ()
    index_kpool: int | None = None

    def __post_init__(self) -> None:
        for i, ratio in enumerate(self.compress_ratios):
            try:
                normalize_compress_ratio(ratio)
            except ValueError as exc:
                raise ValueError(f"compress_ratios[{i}]: {exc}") from None
        if self.index_kpool is not None:
            try:
                normalize_compress_ratio(self.index_kpool)
            except ValueError as exc:
                raise ValueError(f"index_kpool: {exc}") from None


def warmup_compress_ratios(model: ModelConfig) -> tuple[int, ...]:
    """Every ratio the model's indexer layers can launch with, normalised, first-seen order.

    The configured ``compress_ratios`` (or ``(1,)`` when absent), then ``index_kpool`` (absent means 1).
    """
    raw: Iterable[object] = model.compress_ratios or (1,)
    ordered: dict[int, None] = {}
    for ratio in (*raw, model.index_kpool or 1):
        ordered.setdefault(normalize_compress_ratio(ratio), None)
    return tuple(ordered)


def warmup_keys(model: ModelConfig) -> tuple[CompileKey, ...]:
    """The set warmup compiles: one key per normalised ratio.

    Scheduler limits and DCP settings do not enter: the scalars they feed are ``do_not_specialize``, and
    validation keeps them inside i32, so they cannot make a new variant.
    """
    return tuple(CompileKey(compress_ratio=r) for r in warmup_compress_ratios(model))


def key_for_launch(compress_ratio: int, pointers: Sequence[int], scalars: Sequence[int]) -> CompileKey:
    """The variant a real launch needs, from the ratio, the pointer addresses and the scalar values."""
    if len(pointers) != len(POINTER_ARGS) or len(scalars) != len(SCALAR_ARGS):
        raise ValueError(
            f"key_for_launch needs {len(POINTER_ARGS)} pointers and {len(SCALAR_ARGS)} scalars, "
            f"got {len(pointers)} and {len(scalars)}"
        )
    return CompileKey(
        compress_ratio=normalize_compress_ratio(compress_ratio),
        pointer_classes=tuple(pointer_class(p) for p in pointers),
        scalar_types=tuple(triton_int_type(int(s)) for s in scalars),
    )


class TargetSpec(NamedTuple):
    """An ahead-of-time compile target, ``cuda:90`` or ``hip:gfx942``: the fields of Triton's ``GPUTarget``."""

    backend: str
    arch: int | str
    warp_size: int


_WARP_SIZE = {"cuda": 32, "hip": 64}


def parse_target(spec: str) -> TargetSpec:
    """``cuda:90`` or ``hip:gfx942`` checked and split, without importing Triton or torch (the configuration
    checks it in every process, the supervisor's and ``keys`` included); ``ValueError`` says what is wrong."""
    backend, sep, arch = spec.partition(":")
    if not sep or backend not in _WARP_SIZE or not arch:
        raise ValueError(f"target must look like 'cuda:90' or 'hip:gfx942', got {spec!r}")
    if backend == "cuda":
        if not arch.isdigit():
            raise ValueError(f"cuda target needs a numeric compute capability, got {spec!r}")
        return TargetSpec("cuda", int(arch), _WARP_SIZE[backend])
    return TargetSpec("hip", arch, _WARP_SIZE[backend])
