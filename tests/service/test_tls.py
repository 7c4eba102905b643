"""TLS and mutual TLS on the gRPC port, with certificates made by trustme (conftest.py's ``pki``); the HTTP port of
metrics and probes stays plain. The HTTP RPC port's TLS: tests/service/test_http_ports.py."""

from __future__ import annotations

import subprocess

import grpc
import numpy as np
import pytest

from indexer_service.client import IndexerClient, tls_credentials
from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.kernels.numpy_backend import build_chunk_metadata_numpy
from indexer_service.service.config import ConfigError, load_config
from indexer_service.service.process.cli import main as cli_main
from testkit.harness import INDEXER_SERVICE, clean_env, http_get

INPUTS = ChunkInputs(np.array([0, 1, 4, 9]), np.array([20, 10, 5]), 4, 1, 3)


def tls_server(start_server, pki, *extra: str):
    return start_server(
        "--warmup-target", "none", "--tls-cert-file", pki["server_cert"], "--tls-key-file", pki["server_key"], *extra
    )


def test_tls_serves_and_refuses_plaintext(start_server, pki):
    server = tls_server(start_server, pki)
    with IndexerClient([server.address], credentials=tls_credentials(pki["ca"]), timeout=10) as client:
        got = client.build_chunk(INPUTS)
    assert got.cu_seqlen_ke.tolist() == build_chunk_metadata_numpy(INPUTS).cu_seqlen_ke.tolist()
    plain = IndexerClient([server.address], max_attempts=1, health_check=False, wait_for_ready=False, timeout=3)
    with plain, pytest.raises(grpc.RpcError) as info:
        plain.build_chunk(INPUTS)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert http_get(f"{server.http_url}/readyz")[0] == 200  # probes and metrics stay on plain HTTP


def test_mutual_tls_requires_a_client_certificate(start_server, pki, capsys):
    server = tls_server(start_server, pki, "--tls-client-ca-file", pki["ca"])
    anonymous = IndexerClient(
        [server.address],
        max_attempts=1,
        health_check=False,
        wait_for_ready=False,
        timeout=3,
        credentials=tls_credentials(pki["ca"]),
    )
    with anonymous, pytest.raises(grpc.RpcError) as info:
        anonymous.build_chunk(INPUTS)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    mtls = tls_credentials(pki["ca"], pki["client_cert"], pki["client_key"])
    with IndexerClient([server.address], credentials=mtls, timeout=10) as client:
        assert client.build_chunk(INPUTS).total_seq_lens == 3
    args = [
        "check",
        server.address,
        "--tls-ca",
        pki["ca"],
        "--tls-cert",
        pki["client_cert"],
        "--tls-key",
        pki["client_key"],
    ]
    assert cli_main(args) == 0
    assert "health overall=SERVING" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "setting"),
    [
        ({"tls_cert_file": "{server_cert}"}, "tls_key_file"),
        ({"tls_client_ca_file": "{ca}"}, "tls_client_ca_file"),
        ({"tls_cert_file": "/nonexistent.pem", "tls_key_file": "{server_key}"}, "tls_cert_file"),
    ],
    ids=["cert-without-key", "client-ca-without-tls", "unreadable-cert"],
)
def test_bad_tls_config_is_refused_naming_the_setting(pki, flags, setting):
    with pytest.raises(ConfigError) as info:
        load_config({name: value.format(**pki) for name, value in flags.items()} | {"warmup_target": "none"}, env={})
    assert info.value.setting == setting


def run_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [INDEXER_SERVICE, "check", *args, "--timeout", "3"], capture_output=True, text=True, timeout=60, env=clean_env()
    )


def test_check_says_what_a_tls_failure_is_missing(start_server, pki):
    """gRPC reports each of these as "Socket closed" or an OpenSSL code; check names what is missing. Each is
    unreachable (3), the diagnosis on its own line."""
    plain = start_server("--warmup-target", "none")
    tls = tls_server(start_server, pki)
    mutual = tls_server(start_server, pki, "--tls-client-ca-file", pki["ca"])
    cases = [
        ((tls.address,), "tls: this port speaks TLS: connect with --tls-ca PEM"),
        ((plain.address, "--tls-ca", pki["ca"]), "tls: this port does not speak TLS (plaintext)"),
        ((mutual.address, "--tls-ca", pki["ca"]), "requires a client certificate (mutual TLS) does: give --tls-cert"),
        ((tls.address, "--tls"), "tls: the server's certificate does not chain to the system's trusted roots"),
    ]
    for args, diagnosis in cases:
        out = run_check(*args)
        assert out.returncode == 3, (args, out.stdout, out.stderr)
        assert out.stdout.startswith("unreachable") and diagnosis in out.stdout.splitlines()[1], (args, out.stdout)
        assert "Handshake failed" not in out.stderr  # gRPC core's own log line, said better above
    # The control: the same servers with what they need.
    assert run_check(tls.address, "--tls-ca", pki["ca"]).returncode == 0
    full = ("--tls-ca", pki["ca"], "--tls-cert", pki["client_cert"], "--tls-key", pki["client_key"])
    assert run_check(mutual.address, *full).returncode == 0
