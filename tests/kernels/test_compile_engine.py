"""The compile engine: ahead-of-time compilation with no GPU, refusal before the compiler, progress."""

from __future__ import annotations

import ast
import dataclasses
import gc
import subprocess
import sys
import threading
import time

import pytest

from indexer_service.kernels.compile_engine import (
    PROOF_OK,
    KeyRefusedError,
    compile_keys,
    parse_target,
    watch_compiles,
)
from indexer_service.kernels.specialization import CompileKey, ModelConfig, warmup_keys
from indexer_service.kernels.triton_kernel import serialise_ast_parse

DEFAULT_MODEL = ModelConfig((0, 0, *([4, 128] * 20), 4, 0))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    return tmp_path / "triton-cache"


@pytest.mark.parametrize("workers", [1, 2], ids=["sequential", "parallel"])
def test_aot_compiles_the_default_warmup_set_for_cuda90(cache_dir, workers):
    keys = warmup_keys(DEFAULT_MODEL)
    seen = []
    outcomes = compile_keys(keys, keys, target="cuda:90", workers=workers, progress=lambda *a: seen.append(a))
    assert [o.key for o in outcomes] == list(keys)
    failed = [(o.key.label(), o.ok, o.error, o.seconds) for o in outcomes if not (o.ok and o.error is None)]
    assert failed == []  # each failed key whole, with its error (a repr of all outcomes is cut short)
    assert all(o.seconds > 0 for o in outcomes), [o.seconds for o in outcomes]
    assert [(done, total) for done, total, _ in seen] == [(i, len(keys)) for i in range(1, len(keys) + 1)]
    assert {o.key for _, _, o in seen} == set(keys)
    cubins = list(cache_dir.rglob("*.cubin"))
    assert len(cubins) == len(keys)


@pytest.mark.parametrize("workers", [1, 2], ids=["sequential", "parallel"])
def test_a_key_loaded_from_the_cache_says_so(cache_dir, workers):
    """The first compile of a key is the compiler's; the same keys ahead of time again, on the same cache, are
    Triton's cache loads, told apart through its compilation listener. Every key is proved either way."""
    keys = warmup_keys(DEFAULT_MODEL)
    first = compile_keys(keys, keys, target="cuda:90", workers=workers)
    assert [(o.ok, o.cached, o.proof) for o in first] == [(True, False, PROOF_OK)] * len(keys)
    again = compile_keys(keys, keys, target="cuda:90", workers=workers)
    assert [(o.ok, o.cached, o.proof) for o in again] == [(True, True, PROOF_OK)] * len(keys)
    # Another target is another cache entry: compiled, not loaded.
    other = compile_keys(keys[:1], keys, target="cuda:80", workers=workers)
    assert [(o.ok, o.cached) for o in other] == [(True, False)]


def test_loading_the_compile_engine_leaves_torch_alone():
    """Importing the compile engine (and the kernel) loads Triton, not torch."""
    probe = (
        "import sys\n"
        "import indexer_service.kernels.compile_engine, indexer_service.kernels.triton_kernel\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))\n"
        "assert 'triton' in loaded and 'torch' not in loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("workers", [1, 2], ids=["sequential", "parallel"])
def test_an_ahead_of_time_warmup_never_imports_torch(cache_dir, workers):
    """Compiled, loaded from the cache and proved through the interpreter, ahead of time with no GPU, and torch never
    imported (it is most of a CPU server's start): the arguments are host arrays, Triton's binder is set up without
    torch, the proof launches on numpy arrays. A fresh interpreter: this one's tests have imported torch."""
    probe = (
        "import sys\n"
        "from indexer_service.kernels.compile_engine import PROOF_OK, compile_keys\n"
        "from indexer_service.kernels.specialization import ModelConfig, warmup_keys\n"
        "keys = warmup_keys(ModelConfig((4, 128)))\n"
        "for cached in (False, True):\n"
        f"    done = compile_keys(keys, keys, target='cuda:90', workers={workers})\n"
        "    got = [(o.ok, o.cached, o.proof, o.error) for o in done]\n"
        "    assert got == [(True, cached, PROOF_OK, None)] * len(keys), got\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


class _FinalizerThatYields:
    def __del__(self):
        time.sleep(0)  # lets another thread run while the collector frees this in the middle of a parse


def test_ast_parse_lock_is_installed_where_compiles_start_not_on_import():
    """Importing the kernel layer leaves ``ast.parse`` alone; a Triton builder (whose launches compile or
    interpret the kernel) installs the lock. A fresh interpreter: this one's tests have installed it already."""
    probe = (
        "import ast\n"
        "from indexer_service.kernels import compile_engine, launch_combiner, triton_kernel, triton_launcher\n"
        "assert not getattr(ast.parse, 'serialised', False), 'installed on import'\n"
        "triton_launcher.TritonChunkBuilder('cpu', kernel=triton_kernel.interpreted_kernel())\n"
        "assert getattr(ast.parse, 'serialised', False), 'not installed by the builder'\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


def test_ast_parse_is_safe_from_many_threads_once_the_lock_is_installed():
    """CPython 3.11 fails concurrent parses with SystemError 'AST constructor recursion depth mismatch' when the
    collector switches threads mid-parse (a parallel compile lost a key to it in CI). Without the lock this
    stress fails on the first or second of every run here; with it, no parse may fail."""
    serialise_ast_parse()  # what compile_keys and TritonChunkBuilder do before their compiles
    assert getattr(ast.parse, "serialised", False)
    source = "\n".join(f"def f{i}(a, b):\n    return [x * b for x in range({i})]" for i in range(20))
    errors = []

    def parse_with_cyclic_garbage():
        for _ in range(300):
            garbage = _FinalizerThatYields()
            garbage.cycle = garbage
            del garbage
            try:
                ast.parse(source)
            except SystemError as exc:
                errors.append(str(exc))

    thresholds = gc.get_threshold()
    gc.set_threshold(50, 1, 1)  # collect often, so collections land inside parses
    try:
        threads = [threading.Thread(target=parse_with_cyclic_garbage) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        gc.set_threshold(*thresholds)
    assert errors == []


def test_aot_for_amd_gfx942(cache_dir):
    keys = warmup_keys(ModelConfig((4,)))
    outcomes = compile_keys(keys, keys, target="hip:gfx942")
    assert all(o.ok for o in outcomes), outcomes
    assert list(cache_dir.rglob("*.hsaco"))


def test_second_run_loads_from_disk_cache_and_fires_the_compile_hook(cache_dir):
    keys = warmup_keys(ModelConfig((4, 128)))
    compile_keys(keys, keys, target="cuda:90")
    hooked = []
    uninstall = watch_compiles(hooked.append)
    try:
        outcomes = compile_keys(keys, keys, target="cuda:90")
    finally:
        uninstall()
    assert all(o.ok for o in outcomes)
    assert len(hooked) == len(keys)  # a disk-cache load counts, as Triton's hook reports it


def test_key_with_ratio_zero_never_reaches_the_compiler(cache_dir):
    keys = warmup_keys(DEFAULT_MODEL)
    smuggled = dataclasses.replace(keys[0])
    object.__setattr__(smuggled, "compress_ratio", 0)  # what the seed bug produced
    with pytest.raises(KeyRefusedError, match="not normalised"):
        compile_keys([smuggled], [*keys, smuggled], target="cuda:90")
    assert not cache_dir.exists()


def test_key_outside_the_warmup_set_is_refused(cache_dir):
    keys = warmup_keys(DEFAULT_MODEL)
    with pytest.raises(KeyRefusedError, match=r"keys\[1\]: r32-.* not in the model's warmup set"):
        compile_keys([keys[0], CompileKey(32)], keys, target="cuda:90")
    with pytest.raises(KeyRefusedError, match="not a CompileKey"):
        compile_keys([(4, 1024)], keys, target="cuda:90")
    assert not cache_dir.exists()


def test_compiler_failure_is_an_outcome_with_its_message(cache_dir):
    keys = warmup_keys(ModelConfig((4,)))[:1]
    (outcome,) = compile_keys(keys, keys, target="cuda:10")  # no such architecture: ptxas refuses it
    assert not outcome.ok
    assert "sm_10" in outcome.error  # the compiler's own message


@pytest.mark.parametrize("bad", ["cuda", "cuda:sm90", "metal:1", ":90", "hip:"])
def test_bad_target_names(bad):
    with pytest.raises(ValueError, match="target"):
        parse_target(bad)
