"""The operator commands, run as the installed ``indexer-service`` executable: keys, precompile, check, help,
and start-up failures that name what is wrong."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from kernels.specialization import CompileKey
from tests.conftest import (
    FAILING_WARMUP,
    INDEXER_SERVICE,
    LOOPBACK,
    ServerProcess,
    StartServer,
    clean_env,
    cuda_available,
    default_backend_and_target,
)


def run(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [INDEXER_SERVICE, *args], capture_output=True, text=True, timeout=timeout, env=clean_env(**env)
    )


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ((), ("serve", "keys", "precompile", "check")),
        (("serve",), ("--grpc-port", "--http-port", "--port-file", "--warmup-target", "--model-config", "--config",
                      "--strict", "--shutdown-grace-seconds", "INDEXER_")),
        (("keys",), ("--model-config", "--compress-ratios", "--index-kpool")),
        (("precompile",), ("--target", "--cache-dir", "--model-config")),
        (("check",), ("address", "--timeout")),
    ],
)  # fmt: skip
def test_every_command_has_help(command: tuple[str, ...], expected: tuple[str, ...]) -> None:
    out = run(*command, "--help")
    assert out.returncode == 0, out.stderr
    for fragment in expected:
        assert fragment in out.stdout


def key_ratios(stdout: str) -> list[int]:
    keys = [json.loads(line) for line in stdout.splitlines()]
    for key in keys:
        assert json.dumps(key, separators=(",", ":")) == CompileKey(**{
            k: tuple(v) if isinstance(v, list) else v for k, v in key.items()
        }).to_json()  # fmt: skip
        assert set(key) == {"compress_ratio", "block_size", "pointer_classes", "scalar_types"}
    return [key["compress_ratio"] for key in keys]


def test_keys_prints_the_normalised_warmup_set(tmp_path: Path) -> None:
    out = run("keys", "--warmup-target", "none")
    assert out.returncode == 0, out.stderr
    assert key_ratios(out.stdout) == [1, 4, 128]  # the default DeepSeek-V4-Flash config; 0 became 1

    hf = tmp_path / "config.json"
    hf.write_text(json.dumps({"text_config": {"compress_ratios": [0, 0, 4, 128, 0], "index_kpool": 32}}))
    out = run("keys", "--model-config", str(hf), "--warmup-target", "none")
    assert out.returncode == 0, out.stderr
    assert key_ratios(out.stdout) == [1, 4, 128, 32]

    out = run("keys", "--warmup-target", "none", INDEXER_COMPRESS_RATIOS="0,0")
    assert key_ratios(out.stdout) == [1]


def test_precompile_fills_a_triton_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    out = run("precompile", "--target", "cuda:90", "--cache-dir", str(cache))
    assert out.returncode == 0, out.stderr
    for n in (1, 2, 3):
        assert f"precompile {n}/3 key=" in out.stderr
    assert "precompile done keys=3 failed=0" in out.stderr and str(cache) in out.stderr
    assert len(list(cache.rglob("*.cubin"))) == 3


def test_precompile_exits_nonzero_when_a_key_fails(tmp_path: Path) -> None:
    out = run("precompile", "--target", "cuda:1", "--cache-dir", str(tmp_path / "cache"))
    assert out.returncode == 1
    assert "precompile failed keys=3 failed=3" in out.stderr and "sm_1" in out.stderr


def test_precompile_needs_a_target(tmp_path: Path) -> None:
    out = run("precompile", "--target", "none", "--cache-dir", str(tmp_path))
    assert out.returncode == 2 and "warmup_target" in out.stderr


def test_check_a_serving_server(live_server: ServerProcess) -> None:
    out = run("check", live_server.address)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "health overall=SERVING indexer.v1.PrefillMetadata=SERVING"
    backend, target = default_backend_and_target()
    assert lines[1].startswith(f"warmup state=READY ready=true backend={backend} target={target} strict=false keys=3 "
                               "compiled=3 failed=0")  # fmt: skip
    assert [line.split()[1] for line in lines[2:]] == ["r1-b1024-aligned-i32", "r4-b1024-aligned-i32",
                                                       "r128-b1024-aligned-i32"]  # fmt: skip


def test_check_a_server_that_is_not_ready(start_server: StartServer) -> None:
    server = start_server(*FAILING_WARMUP, ready=False)
    out = run("check", server.address)
    assert out.returncode == 1
    assert "health overall=NOT_SERVING" in out.stdout
    assert "warmup state=" in out.stdout and "ready=false" in out.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def test_check_an_unreachable_address() -> None:
    out = run("check", f"{LOOPBACK}:{free_port()}", "--timeout", "2")
    assert out.returncode == 2 and "unreachable" in out.stdout and "UNAVAILABLE" in out.stdout


@pytest.mark.parametrize(
    ("args", "env", "fragment"),
    [
        (("--grpc-port", "70000"), {}, "grpc_port (from flag --grpc-port): must be in [0, 65535]"),
        ((), {"INDEXER_MAX_NUM_SEQS": "many"}, "max_num_seqs (from env INDEXER_MAX_NUM_SEQS)"),
        (("--model-config", "/nonexistent/config.json"), {}, "model_config"),
        pytest.param(("--backend", "triton"), {}, "backend", marks=pytest.mark.skipif(
            cuda_available(), reason="this machine has CUDA: the Triton backend is a valid choice here")),
    ],
)
def test_invalid_config_stops_the_start_naming_the_setting(args: tuple, env: dict, fragment: str) -> None:
    out = run("serve", "--warmup-target", "none", *args, timeout=60, **env)
    assert out.returncode == 2, out.stderr
    assert "invalid config" in out.stderr and fragment in out.stderr


def test_serve_refuses_a_port_in_use() -> None:
    with socket.socket() as busy:
        busy.bind((LOOPBACK, 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = run("serve", "--backend", "numpy", "--warmup-target", "none", "--grpc-host", LOOPBACK,
                  "--grpc-port", str(port), "--http-host", LOOPBACK, "--http-port", "0", timeout=60)  # fmt: skip
    assert out.returncode == 1 and f"cannot bind gRPC to {LOOPBACK}:{port}" in out.stderr
