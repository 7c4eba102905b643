"""TLS and mutual TLS on the gRPC port, with certificates made by trustme (conftest.py's ``pki``); the HTTP port of
metrics and probes stays plain. The HTTP RPC port's TLS: tests/service/test_http_ports.py."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.kernels.naive import build_chunk_metadata_numpy
from indexer_service.service.cli import main as cli_main
from indexer_service.service.client import IndexerClient, tls_credentials
from indexer_service.service.config import ConfigError, load_config
from testkit.harness import http_get

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
