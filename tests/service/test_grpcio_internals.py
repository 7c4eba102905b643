"""The start-up check of what the gRPC transport uses of grpcio's internals (service/transport/grpcio_internals.py):
the installed grpcio has all of it; a grpcio that renamed any of it (here: grpc._server's own source with one name
changed, loaded as a module of its own, so that the grpcio the other tests use is never touched) is named; ``serve``
refuses to start on such a grpcio, one process or several."""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import logging
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import grpc
import pytest
from grpc import _server
from grpc._cython import cygrpc

from indexer_service.service.transport import grpcio_internals
from indexer_service.service.transport.grpcio_internals import TESTED_GRPCIO, check_grpcio, missing_grpcio_internals
from testkit.harness import clean_env, listen_flags

GRPC_SERVER_SOURCE = inspect.getsource(_server)
_MODULES = itertools.count()


def grpc_server_changed(tmp_path: Path, *edits: tuple[str, str]) -> ModuleType:
    """grpc._server as a grpcio release with these edits (each ``old`` text, every occurrence, changed to ``new``)
    would ship it: its source, edited, loaded as a new module (its classes are new ones; grpc._server itself is
    untouched)."""
    source = GRPC_SERVER_SOURCE
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new)
    name = f"changed_grpc_server_{next(_MODULES)}"
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cygrpc_changed(**replaced: object) -> SimpleNamespace:
    """grpcio's Cython module with some names replaced (None: removed)."""
    names = {**vars(cygrpc), **replaced}
    return SimpleNamespace(**{k: v for k, v in names.items() if v is not None})


def test_the_installed_grpcio_has_everything(caplog) -> None:
    assert missing_grpcio_internals() == []
    with caplog.at_level(logging.WARNING, logger=grpcio_internals.__name__):
        check_grpcio()
    tested = grpc.__version__.startswith(f"{TESTED_GRPCIO}.")
    assert [r.getMessage() for r in caplog.records] == (
        []
        if tested
        else [
            f"grpcio {grpc.__version__}: this server is tested with {TESTED_GRPCIO}.x; the internals "
            "it uses are there by name"
        ]
    )


def test_the_unchanged_source_loaded_as_a_module_has_everything(tmp_path: Path) -> None:
    # The control of the tests below: the loading itself loses nothing.
    assert missing_grpcio_internals(grpc_server_changed(tmp_path), cygrpc) == []


@pytest.mark.parametrize(
    ("old", "new", "named"),
    [
        ("def _send_message(", "def _send_message_v2(", "grpc._server._send_message"),
        ("_SEND_MESSAGE_TOKEN =", "_SEND_MSG_TOKEN =", "grpc._server._SEND_MESSAGE_TOKEN"),
        ("def _is_rpc_state_active(", "def _rpc_state_is_active(", "grpc._server._is_rpc_state_active"),
        ("self.callbacks = []", "self.end_callbacks = []", "grpc._server._RPCState.callbacks"),
        ("self.callbacks = []", "self.callbacks = ()", "grpc._server._RPCState.callbacks (a list on a new call)"),
        # grpcio 1.85 also has a class attribute `due`: the instance's own field is what counts
        ("self.due = set()", "self.pending = set()", "grpc._server._RPCState.due"),
        ("self.trailing_metadata = None", "self.trailers = None", "grpc._server._RPCState.trailing_metadata"),
        ("self._rpc_event = rpc_event", "self._event = rpc_event", "grpc._server._Context._rpc_event"),
        ("self._state = state", "self._call_state = state", "grpc._server._Context._state"),
        ("self.request = None", "self.message = None", "grpc._server._RPCState.request"),
        # receive_ahead recognises a unary call by this function and reads its arguments by position
        ("def _unary_response_in_pool(", "def _unary_response(", "grpc._server._unary_response_in_pool"),
        (
            "argument_thunk",
            "request_thunk",
            "grpc._server._unary_response_in_pool(rpc_event, state, behavior, argument_thunk, "
            "request_deserializer, response_serializer)",
        ),
        (
            "    state: _RPCState,\n    call: cygrpc.Call,\n    request_deserializer",
            "    call: cygrpc.Call,\n    state: _RPCState,\n    request_deserializer",
            "grpc._server._receive_message(state, call, request_deserializer)",
        ),
    ],
    ids=lambda value: value if isinstance(value, str) and value.startswith("grpc.") else None,
)
def test_a_renamed_internal_is_named(tmp_path: Path, old: str, new: str, named: str) -> None:
    assert named in missing_grpcio_internals(grpc_server_changed(tmp_path, (old, new)), cygrpc)


def test_a_renamed_behaviour_attribute_is_named(tmp_path: Path) -> None:
    changed = grpc_server_changed(tmp_path, ("experimental_non_blocking", "experimental_nonblocking"))
    assert missing_grpcio_internals(changed, cygrpc) == ["grpc._server reads experimental_non_blocking"]


def test_a_changed_constructor_falls_back_to_the_declared_fields(tmp_path: Path) -> None:
    # A new argument alone is no reason to refuse: the fields are still declared ...
    new_argument = ("    def __init__(self):\n", "    def __init__(self, server):\n")
    assert missing_grpcio_internals(grpc_server_changed(tmp_path, new_argument), cygrpc) == []
    # ... unless one of them is gone too.
    undeclared = ("    callbacks: Optional[List[NullaryCallbackType]]\n", "")
    changed = grpc_server_changed(tmp_path, new_argument, undeclared)
    assert missing_grpcio_internals(changed, cygrpc) == ["grpc._server._RPCState.callbacks"]


def test_a_missing_cython_attribute_is_named(tmp_path: Path) -> None:
    class CallDetailsWithoutDeadline:
        method = b""

    changed = cygrpc_changed(CallDetails=CallDetailsWithoutDeadline, SendMessageOperation=None)
    assert missing_grpcio_internals(_server, changed) == ["cygrpc.CallDetails.deadline", "cygrpc.SendMessageOperation"]


def test_another_version_with_everything_there_starts_with_a_warning(monkeypatch, caplog) -> None:
    monkeypatch.setattr(grpc, "__version__", "1.99.0")
    with caplog.at_level(logging.WARNING, logger=grpcio_internals.__name__):
        check_grpcio()
    assert [r.getMessage() for r in caplog.records] == [
        f"grpcio 1.99.0: this server is tested with {TESTED_GRPCIO}.x; the internals it uses are there by name"
    ]


# `serve` in a process whose grpcio lacks one helper health's send uses, as a grpcio release that renamed it would.
WITHOUT_SEND_MESSAGE = (
    "import sys\n"
    "from grpc import _server\n"
    "del _server._send_message\n"
    "from indexer_service.service.process.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_refuses_a_grpcio_without_what_it_uses(workers: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            WITHOUT_SEND_MESSAGE,
            "serve",
            "--backend",
            "numpy",
            "--warmup-target",
            "none",
            *listen_flags(),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(INDEXER_WORKERS=workers),
    )
    assert out.returncode == 1, out.stderr
    message = (
        f"grpcio {grpc.__version__} lacks what this server uses of its internals (grpc._server._send_message); "
        f"install grpcio {TESTED_GRPCIO}.x"
    )
    # The log line and the command's own line, as every fatal start-up error; nothing started.
    lines = out.stderr.splitlines()
    assert len(lines) == 2 and lines[1].startswith(f"indexer-service serve: {message}"), out.stderr
    assert " ERROR indexer_service.service.process.cli fatal " + message in lines[0], out.stderr
