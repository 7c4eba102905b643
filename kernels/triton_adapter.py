"""Triton past its public API: every reach the compile engine makes into Triton's internals, each a feature with its
public fallback. The kernels never import the service, so this module reports what it finds as plain data
(:func:`fallbacks`), which the service announces (service/adapters/__init__.py's ``probe_all``).

- ``async_compile``: with ``warmup_workers`` above 1 the warmup's keys compile in parallel, through
  ``triton.runtime._async_compile.AsyncCompileMode``, which makes the JIT hand each compile to an executor.
  Fallback: the keys compile one after another (Triton before 3.5 has no such mode).
- ``compiler_key``: Triton hashes its installation (its cache key covers it) before the first key compiles
  (``triton.runtime.cache.triton_key``, or ``triton.compiler.compiler.triton_key`` in older layouts), so that the
  first key's compile seconds are its own. Fallback: Triton hashes it within the first compile, whose seconds
  include it.
- ``compile_only_driver``: an ahead-of-time compile makes a stand-in driver active (Triton's public
  ``driver.set_active``) so that the JIT compiles for a target with no GPU, and then puts back exactly what was active
  before, read from ``driver._active``: nothing when no driver had been made yet, which the public ``driver.active``
  cannot tell, since reading it makes the default driver, and with no GPU that fails. Fallback: the driver the public
  ``driver.active`` gives before the compile is put back after it; where none can be made (no GPU), the stand-in
  stays active afterwards, and a GPU launch in this process, which could not run anyway, fails with its "compiles
  only" error instead of Triton's "0 active drivers". Triton 3.4's ``driver.active`` is a lazy proxy that reading
  does not resolve: put back, it is exactly what was there.
- ``binder_without_torch``: an ahead-of-time compile (no GPU) sets Triton's argument binder up with torch's import
  refused in its thread (``triton.runtime.jit.mangle_type``, the binder's own entry point, called once). Triton's
  native binder imports torch the first time it binds anything, only to recognise ``torch.Tensor`` by its type, and
  reads any other argument's ``data_ptr`` and ``dtype``, which specializes a tensor alike; a process that launches
  nothing on a GPU then never imports torch, which is most of a CPU server's start. Fallback: the binder imports
  torch on its first use, as Triton does.

:func:`probe` checks each name, signature and behaviour a feature relies on, in the installed Triton or in stand-ins
a test gives; :func:`features` decides once a process. The compile engine asks for each reach-in through this module
(:func:`async_compile_mode`, :func:`hash_installation`, :func:`stand_in_active`, :func:`bind_without_torch`) and
takes the public path wherever the feature is off.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import inspect
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType

# The modules each feature looks in (triton_key: the first of those that has it).
ASYNC_COMPILE_MODULE = "triton.runtime._async_compile"
JIT_MODULE = "triton.runtime.jit"
KEY_MODULES = ("triton.runtime.cache", "triton.compiler.compiler")
DRIVER_MODULE = "triton.runtime.driver"
# What each feature relies on, as :func:`probe` names it when it is missing or differs.
RELIED_ON: dict[str, tuple[str, ...]] = {
    "async_compile": (
        ASYNC_COMPILE_MODULE,
        f"{ASYNC_COMPILE_MODULE}.AsyncCompileMode",
        f"{ASYNC_COMPILE_MODULE}.AsyncCompileMode(executor, ignore_errors)",
        f"{ASYNC_COMPILE_MODULE}.AsyncCompileMode as a context manager",
        f"{ASYNC_COMPILE_MODULE}.active_mode",
        f"{JIT_MODULE} uses {ASYNC_COMPILE_MODULE}",
    ),
    "compiler_key": (" / ".join(f"{name}.triton_key()" for name in KEY_MODULES),),
    "compile_only_driver": (
        f"{DRIVER_MODULE}.driver",
        f"{DRIVER_MODULE}.driver.set_active",
        f"{DRIVER_MODULE}.DriverConfig()",
        f"{DRIVER_MODULE}.DriverConfig._active",
        f"{DRIVER_MODULE}.DriverConfig.set_active sets _active",
    ),
    "binder_without_torch": (f"{JIT_MODULE}.mangle_type(arg)",),
}

PUBLIC_PATHS = {
    "async_compile": "the warmup's keys compile one after another, whatever warmup_workers says",
    "compiler_key": "Triton hashes its installation within the first key's compile, whose seconds include it",
    "compile_only_driver": (
        "after an ahead-of-time compile the driver Triton's public driver.active gave before it is made active "
        "again; where none can be made (no GPU) the compile-only stand-in stays active, so a GPU launch in this "
        "process, impossible anyway, fails with its 'compiles only' error instead of '0 active drivers'"
    ),
    "binder_without_torch": (
        "Triton's argument binder imports torch the first time it binds a kernel's arguments, also in a process "
        "that compiles ahead of time and launches nothing on a GPU (seconds of a CPU server's start)"
    ),
}
FEATURES = tuple(PUBLIC_PATHS)


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _takes(function: object, *args: object, **kwargs: object) -> bool:
    """Whether ``function`` can be called with these arguments (its signature binds them)."""
    try:
        inspect.signature(function).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    return True


def probe(
    async_compile: ModuleType | None = None,
    jit: ModuleType | None = None,
    key_modules: tuple[ModuleType | None, ...] | None = None,
    driver_module: ModuleType | None = None,
) -> dict[str, list[str]]:
    """For each feature, what the given modules lack or do otherwise (dotted names; empty: the feature can be on).
    Each argument is a Triton module (the installed one when left out; a test gives a stand-in, or None for one
    that cannot be imported): ``async_compile`` and ``jit`` (``async_compile``), ``key_modules`` (``compiler_key``:
    the modules of :data:`KEY_MODULES`), ``driver_module`` (``compile_only_driver``)."""
    installed = async_compile is None and jit is None and key_modules is None and driver_module is None
    if installed:
        async_compile, jit = _import(ASYNC_COMPILE_MODULE), _import(JIT_MODULE)
        key_modules = tuple(_import(name) for name in KEY_MODULES)
        driver_module = _import(DRIVER_MODULE)
    return {
        "async_compile": _probe_async_compile(async_compile, jit),
        "compiler_key": _probe_compiler_key(key_modules or ()),
        "compile_only_driver": _probe_driver(driver_module),
        "binder_without_torch": _probe_binder(jit),
    }


def _probe_binder(jit: ModuleType | None) -> list[str]:
    """Whether the JIT module has the binder's entry point, callable with one argument."""
    mangle = getattr(jit, "mangle_type", None) if jit is not None else None
    return [] if callable(mangle) and _takes(mangle, 0) else list(RELIED_ON["binder_without_torch"])


def _probe_async_compile(module: ModuleType | None, jit: ModuleType | None) -> list[str]:
    if module is None:
        return [ASYNC_COMPILE_MODULE]
    missing = []
    mode = getattr(module, "AsyncCompileMode", None)
    if not isinstance(mode, type):
        missing.append(f"{ASYNC_COMPILE_MODULE}.AsyncCompileMode")
    else:
        if not _takes(mode, None, ignore_errors=True):  # (executor, ignore_errors=True), as compile_keys makes it
            missing.append(f"{ASYNC_COMPILE_MODULE}.AsyncCompileMode(executor, ignore_errors)")
        if not (hasattr(mode, "__enter__") and hasattr(mode, "__exit__")):
            missing.append(f"{ASYNC_COMPILE_MODULE}.AsyncCompileMode as a context manager")
    if not hasattr(module, "active_mode"):
        missing.append(f"{ASYNC_COMPILE_MODULE}.active_mode")
    # The JIT looks for the active mode through the module: a JIT that does not know it would compile every key on
    # the calling thread, one by one, with nothing said.
    if jit is None or not any(value is module for value in vars(jit).values()):
        missing.append(f"{JIT_MODULE} uses {ASYNC_COMPILE_MODULE}")
    return missing


def _probe_compiler_key(modules: tuple[ModuleType | None, ...]) -> list[str]:
    if _triton_key(modules) is not None:
        return []
    return list(RELIED_ON["compiler_key"])


def _triton_key(modules: tuple[ModuleType | None, ...]) -> object | None:
    """The first module's ``triton_key`` that can be called with no argument."""
    for module in modules:
        function = getattr(module, "triton_key", None)
        if callable(function) and _takes(function):
            return function
    return None


def _probe_driver(module: ModuleType | None) -> list[str]:
    """Whether a fresh ``DriverConfig`` (made as Triton makes its own, which makes no driver) keeps the active driver
    in ``_active``, None until one is made, and ``set_active`` sets it there."""
    driver = getattr(module, "driver", None) if module is not None else None
    if driver is None:
        return [f"{DRIVER_MODULE}.driver"]
    if not callable(getattr(driver, "set_active", None)):
        return [f"{DRIVER_MODULE}.driver.set_active"]
    try:
        fresh = type(driver)()
    except Exception:  # a constructor that takes arguments: its fields cannot be told
        return [f"{DRIVER_MODULE}.DriverConfig()"]
    if "_active" not in vars(fresh) or fresh._active is not None:
        return [f"{DRIVER_MODULE}.DriverConfig._active"]
    marker = object()
    try:
        fresh.set_active(marker)
        kept = fresh._active is marker
    except Exception:
        kept = False
    return [] if kept else [f"{DRIVER_MODULE}.DriverConfig.set_active sets _active"]


@dataclass(frozen=True)
class TritonFeatures:
    """Which Triton features are on in this process (the others are on their public path)."""

    async_compile: bool
    compiler_key: bool
    compile_only_driver: bool
    binder_without_torch: bool


@functools.cache
def probed() -> dict[str, list[str]]:
    """:func:`probe` of the installed Triton, once a process."""
    return probe()


def features() -> TritonFeatures:
    """This process's Triton features."""
    return TritonFeatures(**{feature: not missing for feature, missing in probed().items()})


def fallbacks() -> list[tuple[str, tuple[str, ...], str]]:
    """``(feature, what is missing, what runs instead)`` for each feature on its public path in this process."""
    return [(feature, tuple(missing), PUBLIC_PATHS[feature]) for feature, missing in probed().items() if missing]


# -- the reach-ins, each on its public path where its feature is off ----------------------------------------------


def async_compile_mode() -> type | None:
    """Triton's ``AsyncCompileMode``; None where ``async_compile`` is off (compile the keys one by one)."""
    if not features().async_compile:
        return None
    return importlib.import_module(ASYNC_COMPILE_MODULE).AsyncCompileMode


def hash_installation() -> bool:
    """Hash the Triton installation now, as the first compile would (it is cached for the process); False where
    ``compiler_key`` is off (the first compile does it)."""
    if not features().compiler_key:
        return False
    _triton_key(tuple(_import(name) for name in KEY_MODULES))()
    return True


@contextlib.contextmanager
def stand_in_active(stand_in: object, config: object | None = None) -> Iterator[None]:
    """Within this block ``stand_in`` is Triton's active driver; after it, what was active before is again (see
    ``compile_only_driver`` above on where the public path cannot tell). ``config``: Triton's driver configuration
    (``triton.runtime.driver.driver`` by default; tests give a stand-in)."""
    if config is None:
        config = importlib.import_module(DRIVER_MODULE).driver
    exact = features().compile_only_driver
    if exact:
        previous = config._active  # None (no driver made yet) stays None: the default is made on first use
    else:
        try:
            previous = config.active
        except Exception:  # no driver can be made here (no GPU): nothing to put back
            previous = None
    config.set_active(stand_in)
    try:
        yield
    finally:
        if previous is not None or exact:
            config.set_active(previous)


class _RefusedInThread(importlib.abc.MetaPathFinder):
    """Refuses the import of ``names`` to the thread that made it (any other thread imports them as usual)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)
        self.thread = threading.get_ident()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in self.names and threading.get_ident() == self.thread:
            raise ModuleNotFoundError(
                f"No module named {fullname!r} (kept out of a compile-only process)", name=fullname
            )
        return None


@contextlib.contextmanager
def refused_in_this_thread(*names: str) -> Iterator[None]:
    """Within this block, importing one of ``names`` (not imported yet) fails in this thread."""
    finder = _RefusedInThread(names)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def bind_without_torch() -> bool:
    """Set Triton's argument binder up now, with torch's import refused in this thread, where torch is not imported
    yet (``binder_without_torch`` above); True when torch stayed out. The binder keeps what it found for the life of
    the process, so call it only where nothing will launch on a GPU. A binder that cannot be set up so is left alone:
    its first use sets it up, with torch, as on the public path."""
    if "torch" in sys.modules or not features().binder_without_torch:
        return False
    with refused_in_this_thread("torch"):
        try:
            importlib.import_module(JIT_MODULE).mangle_type(0)
        except Exception:
            return False
    return "torch" not in sys.modules
