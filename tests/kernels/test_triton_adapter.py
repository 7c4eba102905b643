"""Triton past its public API (kernels/triton_adapter.py): each name, signature and behaviour a feature relies on,
hidden in turn in stand-ins of Triton's modules, takes exactly that feature onto its public path, reported as plain
data; the driver swap puts back exactly what was active, by ``_active`` or, on the public path, by ``driver.active``
(Triton 3.4's lazy proxy included); and the compile engine on each public path compiles the warmup set ahead of time
for ``cuda:90`` and proves every key through Triton's interpreter on this CPU. The service's side (announced once,
the start line, the gauge) is tests/service/test_adapters.py's."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
from triton.runtime.driver import driver
from triton.runtime.errors import InterpreterError

from indexer_service.kernels import compile_engine, triton_adapter, triton_kernel
from indexer_service.kernels.compile_engine import compile_keys
from indexer_service.kernels.inputs import ChunkInputs, chunk_host_part
from indexer_service.kernels.numpy_backend import chunk_arrays_numpy
from indexer_service.kernels.specialization import ModelConfig, warmup_keys
from indexer_service.kernels.triton_launcher import TritonChunkBuilder

FEATURES = triton_adapter.FEATURES
A, D = triton_adapter.ASYNC_COMPILE_MODULE, triton_adapter.DRIVER_MODULE


def module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:  # a Triton without it (3.4 has no async compile module)
        return None


def installed() -> dict[str, Any]:
    """The installed Triton's modules, as :func:`triton_adapter.probe` takes them."""
    return {
        "async_compile": module(A),
        "jit": module(triton_adapter.JIT_MODULE),
        "key_modules": tuple(module(name) for name in triton_adapter.KEY_MODULES),
        "driver_module": module(D),
    }


def copy(module: ModuleType, **replaced: object) -> SimpleNamespace:
    """``module``'s names with some replaced (None: removed)."""
    names = {**vars(module), **replaced}
    return SimpleNamespace(**{name: value for name, value in names.items() if value is not None})


class LazyProxy:
    """Triton 3.4's stand-in for the default driver, made on first use (never here)."""


class DriverConfig34:
    """``DriverConfig`` as Triton 3.4 ships it: ``active`` a plain attribute, the lazy default until set."""

    def __init__(self) -> None:
        self.default = LazyProxy()
        self.active = self.default

    def set_active(self, driver: object) -> None:
        self.active = driver

    def reset_active(self) -> None:
        self.active = self.default


class DriverConfig39:
    """``DriverConfig`` as later Tritons ship it: ``_active`` None until ``active`` makes the default driver, which
    fails with no GPU (``default``: what making it gives, or raises)."""

    def __init__(self, default: object = None) -> None:
        self._default = default
        self._active = None

    @property
    def active(self) -> object:
        if self._active is None:
            if self._default is None:
                raise RuntimeError("0 active drivers ([]). There should only be one.")
            self._active = self._default
        return self._active

    def set_active(self, driver: object) -> None:
        self._active = driver


def hidden(name: str) -> dict[str, Any]:
    """The installed modules as a Triton without ``name`` (one of RELIED_ON) would ship them."""
    modules = installed()
    if name == A:
        modules["async_compile"] = None
    elif name == f"{A}.AsyncCompileMode":
        modules["async_compile"] = copy(modules["async_compile"], AsyncCompileMode=None)
    elif name == f"{A}.AsyncCompileMode(executor, ignore_errors)":
        mode = modules["async_compile"].AsyncCompileMode
        narrower = type("AsyncCompileMode", (mode,), {"__init__": lambda self, executor: None})
        modules["async_compile"] = copy(modules["async_compile"], AsyncCompileMode=narrower)
    elif name == f"{A}.AsyncCompileMode as a context manager":
        init = {"__init__": lambda self, executor, *, ignore_errors=False: None}
        modules["async_compile"] = copy(modules["async_compile"], AsyncCompileMode=type("AsyncCompileMode", (), init))
    elif name == f"{A}.active_mode":
        modules["async_compile"] = copy(modules["async_compile"], active_mode=None)
    elif name == f"{triton_adapter.JIT_MODULE} uses {A}":
        jit = modules["jit"]
        modules["jit"] = copy(jit, **{k: None for k, v in vars(jit).items() if v is modules["async_compile"]})
    elif name in triton_adapter.RELIED_ON["compiler_key"]:
        modules["key_modules"] = tuple(copy(m, triton_key=None) for m in modules["key_modules"])
    elif name == f"{D}.driver":
        modules["driver_module"] = copy(modules["driver_module"], driver=None)
    elif name == f"{D}.driver.set_active":
        modules["driver_module"] = SimpleNamespace(driver=SimpleNamespace(_active=None))
    elif name == f"{D}.DriverConfig()":
        needs_arguments = type("DriverConfig", (DriverConfig39,), {"__init__": lambda self, backend: None})
        modules["driver_module"] = SimpleNamespace(driver=needs_arguments.__new__(needs_arguments))
    elif name == f"{D}.DriverConfig._active":
        modules["driver_module"] = SimpleNamespace(driver=DriverConfig34())
    elif name == f"{D}.DriverConfig.set_active sets _active":
        elsewhere = type("DriverConfig", (DriverConfig39,), {"set_active": lambda self, d: setattr(self, "chosen", d)})
        modules["driver_module"] = SimpleNamespace(driver=elsewhere())
    elif name in triton_adapter.RELIED_ON["binder_without_torch"]:
        modules["jit"] = copy(modules["jit"], mangle_type=None)
    else:
        raise AssertionError(f"no way to hide {name}")
    original = installed()["async_compile"]
    if modules["async_compile"] not in (original, None) and modules["jit"] is installed()["jit"]:
        # The JIT of that Triton would use its own module: the copy.
        jit = modules["jit"]
        modules["jit"] = copy(jit, **{k: modules["async_compile"] for k, v in vars(jit).items() if v is original})
    return modules


def test_the_installed_triton_has_every_feature() -> None:
    assert triton_adapter.probe() == {feature: [] for feature in FEATURES}
    assert triton_adapter.probe(**installed()) == {feature: [] for feature in FEATURES}
    assert triton_adapter.fallbacks() == []


RELIED_ON = [(feature, name) for feature, names in triton_adapter.RELIED_ON.items() for name in names]


@pytest.mark.parametrize(("feature", "name"), RELIED_ON, ids=[name for _, name in RELIED_ON])
def test_each_hidden_name_takes_exactly_its_feature(monkeypatch, feature: str, name: str) -> None:
    base = triton_adapter.probe()  # the installed Triton's: nothing missing on the tested one
    if base[feature]:  # an older Triton of the declared range (3.4 has no async compile): nothing there to hide
        pytest.skip(f"this Triton has no {feature} to hide a name from: {base[feature]}")
    missing = triton_adapter.probe(**hidden(name))
    others = {f: found for f, found in base.items() if found and f != feature}
    assert {f: found for f, found in missing.items() if found} == {**others, feature: [name]}
    only = {f: found if f == feature else [] for f, found in missing.items()}  # as reported on a tested Triton
    monkeypatch.setattr(triton_adapter, "probed", lambda: only)
    assert triton_adapter.fallbacks() == [(feature, (name,), triton_adapter.PUBLIC_PATHS[feature])]
    chosen = triton_adapter.features()
    assert {f for f in FEATURES if not getattr(chosen, f)} == {feature}


def test_triton_key_in_the_older_layout_is_enough() -> None:
    """Triton 3.4 keeps triton_key in triton.compiler.compiler only."""
    modules = installed()
    cache, compiler = modules["key_modules"]
    key = getattr(cache, "triton_key", None) or compiler.triton_key
    modules["key_modules"] = (copy(cache, triton_key=None), copy(compiler, triton_key=key))
    assert triton_adapter.probe(**modules)["compiler_key"] == []


def on_public_path(monkeypatch: pytest.MonkeyPatch, *features: str, others: str = "installed") -> None:
    """This process's Triton, with ``features`` on their public path, and the others as the installed Triton has
    them (``others="on"``: on, for stand-ins that have what they rely on)."""
    base = triton_adapter.probe() if others == "installed" else {feature: [] for feature in FEATURES}
    missing = {feature: base[feature] or ([f"hidden {feature}"] if feature in features else []) for feature in FEATURES}
    monkeypatch.setattr(triton_adapter, "probed", lambda: missing)


class StandIn:
    """A driver that only stands in."""


def test_the_swap_puts_back_what_was_active_through_active(monkeypatch) -> None:
    """``_active`` on: None (no driver made yet) stays None; a driver made stays that driver."""
    on_public_path(monkeypatch, others="on")
    config = DriverConfig39()
    with triton_adapter.stand_in_active(StandIn(), config):
        assert isinstance(config.active, StandIn)
    assert config._active is None
    made = object()
    config.set_active(made)
    with triton_adapter.stand_in_active(StandIn(), config):
        assert isinstance(config.active, StandIn)
    assert config.active is made


def test_on_the_public_path_the_swap_puts_back_tritons_34_lazy_proxy_exactly(monkeypatch) -> None:
    on_public_path(monkeypatch, "compile_only_driver")
    config = DriverConfig34()
    lazy = config.active
    with triton_adapter.stand_in_active(StandIn(), config):
        assert isinstance(config.active, StandIn)
    assert config.active is lazy


@pytest.mark.parametrize("gpu", [True, False], ids=["a-driver", "no-gpu"])
def test_on_the_public_path_a_later_triton_gets_back_its_driver_or_keeps_the_stand_in(monkeypatch, gpu: bool) -> None:
    """Where ``active`` can make the default driver it is put back; where it cannot (no GPU), the stand-in stays."""
    on_public_path(monkeypatch, "compile_only_driver")
    default = object()
    config = DriverConfig39(default if gpu else None)
    stand_in = StandIn()
    with triton_adapter.stand_in_active(stand_in, config):
        assert config.active is stand_in
    assert config.active is (default if gpu else stand_in)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    return tmp_path / "triton-cache"


@pytest.fixture
def driver_kept() -> Iterator[None]:
    """Triton's driver configuration is put back after the test, whatever the public path left active."""
    kept = dict(vars(driver))
    yield
    vars(driver).clear()
    vars(driver).update(kept)


def interpreted_launch_agrees_with_numpy() -> bool:
    inputs = ChunkInputs(np.array([0, 3, 9]), np.array([17, 40]), 4, 0, 2)
    host = chunk_host_part(inputs)
    builder = TritonChunkBuilder("cpu", kernel=triton_kernel.interpreted_kernel(), combine=False)
    got, expected = builder.arrays(host, inputs.dcp), chunk_arrays_numpy(host, inputs.dcp)
    return all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("feature", FEATURES)
def test_the_compile_engine_on_each_public_path_compiles_and_proves_ahead_of_time(
    monkeypatch, cache_dir: Path, driver_kept: None, feature: str
) -> None:
    """Two workers, ahead of time for cuda:90 with no GPU: every key compiles (one cubin each) and its proof launch
    through the interpreter agrees with numpy; the public path's own effect is there; the interpreter still runs."""
    on_public_path(monkeypatch, feature)
    try:
        before = driver.active  # public; with no GPU, a Triton after 3.4 cannot make one and raises
    except RuntimeError:
        before = None
    keys = warmup_keys(ModelConfig((4, 128)))
    outcomes = compile_keys(keys, keys, target="cuda:90", workers=2)
    assert [(o.key, o.ok, o.error) for o in outcomes] == [(k, True, None) for k in keys]
    assert len(list(cache_dir.rglob("*.cubin"))) == len(keys)
    if feature == "async_compile":
        assert triton_adapter.async_compile_mode() is None
    elif feature == "compiler_key":
        assert compile_engine.start_compiler() is None
    elif feature == "binder_without_torch":
        assert triton_adapter.bind_without_torch() is False
    elif before is not None:  # a GPU's driver, or Triton 3.4's lazy proxy: put back exactly
        assert driver.active is before
    else:  # with nothing to put back the stand-in stays, as its public path says
        assert isinstance(driver.active, compile_engine._StandInDriver)
    try:
        assert interpreted_launch_agrees_with_numpy()
    except InterpreterError as exc:  # as tests/conftest.py's triton_cpu: the proofs were skipped likewise
        if "only 0-dimensional arrays" not in str(exc):
            raise
        pytest.skip(f"compiled; this Triton's interpreter cannot run with this numpy: {exc}")
