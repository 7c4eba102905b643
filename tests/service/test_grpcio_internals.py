"""The start-up check of what the gRPC transport uses of grpcio's private call state (service/transport/
grpcio_internals.py): the installed grpcio has all of it and is the tested version; each name taken away is named;
``serve`` refuses to start on such a grpcio, one process or several, with one line and exit 1."""

from __future__ import annotations

import logging
import subprocess
import sys

import grpc
import pytest
from grpc import _server
from grpc._cython import cygrpc

from indexer_service.service.transport import grpcio_internals
from indexer_service.service.transport.grpcio_internals import (
    TESTED_GRPCIO,
    check_grpcio,
    missing_grpcio_internals,
)
from testkit.harness import clean_env, listen_flags


def test_the_installed_grpcio_has_everything_and_is_the_tested_version(caplog) -> None:
    # When the lock files move to another grpcio, this fails until TESTED_GRPCIO (and the code using the call
    # state, if it changed) is brought along.
    assert grpc.__version__.startswith(f"{TESTED_GRPCIO}.")
    assert missing_grpcio_internals() == []
    with caplog.at_level(logging.WARNING, logger=grpcio_internals.__name__):
        check_grpcio()
    assert caplog.records == []


@pytest.mark.parametrize("name", grpcio_internals._SERVER_MODULE_NAMES)
def test_a_missing_module_name_is_named_and_refused(monkeypatch, name: str) -> None:
    monkeypatch.delattr(_server, name)
    assert f"grpc._server.{name}" in missing_grpcio_internals()
    with pytest.raises(RuntimeError, match=rf"grpcio .* lacks .*grpc\._server\.{name}\b.*install grpcio"):
        check_grpcio()


@pytest.mark.parametrize("field", grpcio_internals._STATE_FIELDS)
def test_a_missing_call_state_field_is_named(monkeypatch, field: str) -> None:
    class RenamedState(_server._RPCState):
        def __init__(self) -> None:
            super().__init__()
            delattr(self, field)

    monkeypatch.setattr(_server, "_RPCState", RenamedState)
    assert f"grpc._server._RPCState.{field}" in missing_grpcio_internals()


def test_end_callbacks_that_are_not_a_list_and_a_context_over_other_fields_are_named(monkeypatch) -> None:
    class TupleCallbacks(_server._RPCState):
        def __init__(self) -> None:
            super().__init__()
            self.callbacks = ()

    class OtherContext(_server._Context):
        def __init__(self, rpc_event, state, request_deserializer) -> None:
            self._event = rpc_event
            self._call_state = state

    monkeypatch.setattr(_server, "_RPCState", TupleCallbacks)
    monkeypatch.setattr(_server, "_Context", OtherContext)
    missing = missing_grpcio_internals()
    assert "grpc._server._RPCState.callbacks (a list on a new call)" in missing
    assert {"grpc._server._Context._rpc_event", "grpc._server._Context._state"} <= set(missing)


def test_a_changed_constructor_is_named(monkeypatch) -> None:
    class NeedsArguments(_server._RPCState):
        def __init__(self, server) -> None:
            super().__init__()

    monkeypatch.setattr(_server, "_RPCState", NeedsArguments)
    (problem,) = missing_grpcio_internals()
    assert problem.startswith("grpc._server._RPCState() / _Context(event, state, deserializer): ")


def test_a_missing_cython_attribute_is_named(monkeypatch) -> None:
    class CallDetailsWithoutDeadline:
        method = b""

    monkeypatch.setattr(cygrpc, "CallDetails", CallDetailsWithoutDeadline)
    monkeypatch.delattr(cygrpc, "SendMessageOperation")
    assert missing_grpcio_internals() == ["cygrpc.CallDetails.deadline", "cygrpc.SendMessageOperation"]


def test_another_version_with_everything_there_starts_with_a_warning(monkeypatch, caplog) -> None:
    monkeypatch.setattr(grpc, "__version__", "1.99.0")
    with caplog.at_level(logging.WARNING, logger=grpcio_internals.__name__):
        check_grpcio()
    (record,) = caplog.records
    assert record.getMessage() == (
        f"grpcio 1.99.0: this server is tested with {TESTED_GRPCIO}.x; the call state it uses is there by name"
    )


# `serve` in a process whose grpcio lacks one helper health's send uses, as a grpcio release that renamed it would.
WITHOUT_SEND_MESSAGE = (
    "import sys\n"
    "from grpc import _server\n"
    "del _server._send_message\n"
    "from indexer_service.service.process.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_refuses_a_grpcio_without_the_call_state_it_uses(workers: str) -> None:
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
    errors = [line for line in out.stderr.splitlines() if line.startswith("indexer-service serve:")]
    assert len(errors) == 1, out.stderr
    assert (
        f"grpcio {grpc.__version__} lacks what this server uses of its call state (grpc._server._send_message)"
        in (errors[0])
    )
    assert "Traceback" not in out.stderr and "starting" not in out.stderr.lower()
