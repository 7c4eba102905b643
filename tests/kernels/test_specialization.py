"""The specialization model: one normalisation, the warmup set, and that every reachable key is warmed."""

from __future__ import annotations

import json

import numpy as np
import pytest
import triton
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer_service.kernels.compile_engine import compile_only_driver, parse_target, warmup_arguments, watch_compiles
from indexer_service.kernels.inputs import DcpConfig
from indexer_service.kernels.specialization import (
    POINTER_ARGS,
    SCALAR_ARGS,
    CompileKey,
    ModelConfig,
    key_for_launch,
    normalize_compress_ratio,
    triton_int_specialization_class,
    warmup_compress_ratios,
    warmup_keys,
)
from indexer_service.kernels.triton_kernel import KERNEL_JIT_OPTIONS, _build_prefill_metadata_kernel_fn
from indexer_service.kernels.triton_launcher import TritonChunkBuilder
from testkit.batches import BatchShape, random_chunk_inputs
from testkit.vllm import vllm_warmup_points
from tests.conftest import examples
from tests.golden import GOLDEN

FLASH_RATIOS = (0, 0, *([4, 128] * 20), 4, 0)


def ratios_of(keys) -> set[int]:
    return {k.compress_ratio for k in keys}


def test_seed_regression_zero_ratio_means_uncompressed():
    assert ratios_of(warmup_keys(ModelConfig((0, 0, 4, 128, 0)))) == {1, 4, 128}
    assert ratios_of(warmup_keys(ModelConfig((0, 0, 4, 128, 0), index_kpool=32))) == {1, 4, 32, 128}
    assert ratios_of(warmup_keys(ModelConfig(FLASH_RATIOS))) == {1, 4, 128}


@pytest.mark.parametrize(
    "case", GOLDEN["warmup_compress_ratios"], ids=lambda c: f"{c['compress_ratios']}-{c['index_kpool']}"[:40]
)
def test_warmup_ratios_match_golden(case):
    model = ModelConfig(tuple(case["compress_ratios"] or ()), case["index_kpool"])
    assert list(warmup_compress_ratios(model)) == case["expected"]


@pytest.mark.parametrize(
    "model", [ModelConfig(), ModelConfig(FLASH_RATIOS), ModelConfig((0,), 0), ModelConfig((4,), 4)]
)
def test_no_key_has_ratio_zero(model):
    assert all(k.compress_ratio >= 1 for k in warmup_keys(model))


@pytest.mark.parametrize("bad", [-1, -4, 2.5, "4", True, None])
def test_bad_ratios_are_rejected(bad):
    with pytest.raises(ValueError, match="compress ratio"):
        normalize_compress_ratio(bad)


def test_config_with_negative_ratio_names_the_index():
    with pytest.raises(ValueError, match=r"compress_ratios\[2\]"):
        ModelConfig((0, 4, -4))
    with pytest.raises(ValueError, match="index_kpool"):
        ModelConfig((4,), index_kpool=-1)


def test_key_refuses_unnormalised_ratio():
    with pytest.raises(ValueError, match="normalize_compress_ratio"):
        CompileKey(compress_ratio=0)


def test_key_json_names_every_axis():
    record = json.loads(CompileKey(4).to_json())
    assert record == {
        "compress_ratio": 4,
        "block_size": 1024,
        "pointer_classes": [16] * len(POINTER_ARGS),
        "scalar_types": ["i32"] * len(SCALAR_ARGS),
    }


def test_triton_integer_classes():
    # value: its class (1; divisible by 16; any other i32; i64 and u64 keep their value)
    expected = {1: 1, 0: 16, -16: 16, 32: 16, 3: 2, 2**31: 2**31, 2**31 + 1: 2**31 + 1, 2**63: 2**63}
    assert {v: triton_int_specialization_class(v) for v in expected} == expected
    with pytest.raises(OverflowError):
        triton_int_specialization_class(2**64)


def test_key_for_launch_sees_unaligned_pointers_and_wide_scalars():
    key = key_for_launch(0, [0, 4, 16, 32], [0, 2**40, 1])
    assert key.compress_ratio == 1
    assert key.pointer_classes[1] == 1 and key.scalar_types[1] == "i64"
    assert key not in warmup_keys(ModelConfig())


class _CompileOnly:
    """Stands in for ``kernel[grid]``: asks Triton for the launch's variant (compiling it if missing)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel.warmup(*args, grid=grid, **kwargs)


@st.composite
def configs_and_requests(draw):
    ratios = draw(st.lists(st.sampled_from([0, 1, 4, 32, 128]), min_size=0, max_size=6))
    kpool = draw(st.sampled_from([None, 0, 1, 4, 32]))
    model = ModelConfig(tuple(ratios), kpool)
    ratio = draw(st.sampled_from(warmup_compress_ratios(model)))
    shape = BatchShape(draw(st.integers(1, 9)), draw(st.integers(1, 40)), draw(st.integers(0, 300)))
    world = draw(st.sampled_from([1, 2, 4, 16]))
    dcp = DcpConfig(draw(st.integers(0, world - 1)), world, draw(st.sampled_from([1, 2, 16])))
    return model, ratio, shape, dcp, draw(st.integers(0, 2**32 - 1))


@given(configs_and_requests())
@settings(max_examples=examples(60), deadline=None)
def test_key_for_launch_of_every_service_launch_is_warmed(args):
    """Property: the key of every launch the service's builder makes is in warmup_keys(config)."""
    model, ratio, shape, dcp, seed = args
    launched = []
    builder = TritonChunkBuilder("cpu", kernel=_CompileOnly(_NoRun()), admit=launched.append)
    builder(random_chunk_inputs(np.random.default_rng(seed), shape, ratio, dcp))
    assert set(launched) <= set(warmup_keys(model))


class _NoRun:
    def warmup(self, *args, **kwargs):
        return None


def test_triton_itself_compiles_nothing_beyond_the_warmup_set():
    """Triton's real JIT (for cuda:90 through a stand-in driver) agrees with the key model.

    After warming the keys of warmup_keys(model), launches of random valid requests of every shape, ratio,
    query slice and DCP setting trigger zero compiles; an unaligned pointer triggers one (the check is live).
    """
    model = ModelConfig(FLASH_RATIOS, index_kpool=32)
    kernel = triton.jit(_build_prefill_metadata_kernel_fn, **KERNEL_JIT_OPTIONS)
    compiles = []
    with compile_only_driver(parse_target("cuda:90")):
        for key in warmup_keys(model):
            kernel.warmup(
                *warmup_arguments(key, "cpu"), grid=(1,), BLOCK_SIZE=key.block_size, COMPRESS_RATIO=key.compress_ratio
            )
        uninstall = watch_compiles(compiles.append)
        try:
            builder = TritonChunkBuilder("cpu", kernel=_CompileOnly(kernel))
            rng = np.random.default_rng(7)
            for i in range(200):
                ratio = warmup_compress_ratios(model)[i % 4]
                world = (1, 2, 4, 16)[i % 4]
                dcp = DcpConfig(int(rng.integers(0, world)), world, (1, 2)[i % 2])
                shape = BatchShape(int(rng.integers(1, 20)), int(rng.integers(1, 64)), int(rng.integers(0, 500)))
                builder(random_chunk_inputs(rng, shape, ratio, dcp))
            assert compiles == []

            unaligned = CompileKey(4, pointer_classes=(1,) + (16,) * (len(POINTER_ARGS) - 1))
            kernel.warmup(*warmup_arguments(unaligned, "cpu"), grid=(1,), BLOCK_SIZE=1024, COMPRESS_RATIO=4)
            assert len(compiles) == 1
        finally:
            uninstall()


@pytest.mark.parametrize("model", [ModelConfig(FLASH_RATIOS), ModelConfig((0, 0, 4, 128, 0), 32), ModelConfig()])
def test_every_warmup_key_is_reachable_by_a_valid_request(model):
    reached = []
    builder = TritonChunkBuilder("cpu", kernel=_CompileOnly(_NoRun()), admit=reached.append)
    for ratio in warmup_compress_ratios(model):
        builder(random_chunk_inputs(np.random.default_rng(ratio), BatchShape(4, 8, 600), ratio))
    assert set(reached) == set(warmup_keys(model))


@pytest.mark.parametrize(
    ("model", "max_num_batched_tokens", "keys"),
    [
        (ModelConfig(FLASH_RATIOS), 8192, 54),
        (ModelConfig((0, 0, 4, 128, 0), 32), 8192, 72),
        (ModelConfig(), 8192, 18),
        (ModelConfig(FLASH_RATIOS), 4, 36),
        (ModelConfig(FLASH_RATIOS), 1, 36),
    ],
    ids=["flash", "kpool32", "v32", "mnbt4", "mnbt1"],
)
def test_the_benchmark_baseline_is_vllms_key_space(model, max_num_batched_tokens, keys):
    """The spec's key counts (section 4): what the vLLM-style warmup baseline compiles one by one."""
    assert len(vllm_warmup_points(model, max_num_batched_tokens)) == keys
