"""The operator commands, run as the installed ``indexer-service`` executable: keys, precompile, check, help,
and start-up failures that name what is wrong."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from indexer_service.kernels.specialization import CompileKey
from testkit.harness import INDEXER_SERVICE, LOOPBACK, ServiceProcess, clean_env, listen_flags
from tests.conftest import cuda_available
from tests.service.conftest import FAILING_WARMUP, StartServer, default_backend_and_target


def run(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [INDEXER_SERVICE, *args], capture_output=True, text=True, timeout=timeout, env=clean_env(**env)
    )


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ((), ("serve", "keys", "precompile", "check")),
        (
            ("serve",),
            (
                "--grpc-port",
                "--http-port",
                "--port-file",
                "--warmup-target",
                "--model-config",
                "--config",
                "--strict",
                "--shutdown-grace-seconds",
                "INDEXER_",
            ),
        ),
        (("keys",), ("--model-config", "--compress-ratios", "--index-kpool")),
        (("precompile",), ("--target", "--cache-dir", "--model-config")),
        (("check",), ("address", "--timeout", "--tls", "--tls-ca", "3 when unreachable", "2 on a usage error")),
    ],
)
def test_every_command_has_help(command: tuple[str, ...], expected: tuple[str, ...]) -> None:
    out = run(*command, "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps lines
    for fragment in expected:
        assert fragment in text


def key_ratios(stdout: str) -> list[int]:
    keys = [json.loads(line) for line in stdout.splitlines()]
    for key in keys:
        assert (
            json.dumps(key, separators=(",", ":"))
            == CompileKey(**{k: tuple(v) if isinstance(v, list) else v for k, v in key.items()}).to_json()
        )
        assert set(key) == {"compress_ratio", "block_size", "pointer_classes", "scalar_types"}
    return [key["compress_ratio"] for key in keys]


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    """`indexer-service keys | head -0`: the pipe's reader is gone before the first line. The command exits as a
    process killed by SIGPIPE does (141), with nothing on stderr: no traceback, no "Exception ignored"."""
    env = clean_env()
    env.pop("PYTHONUNBUFFERED", None)  # a pipe's stdout is block-buffered, as under a shell
    process = subprocess.Popen(
        [INDEXER_SERVICE, "keys", "--warmup-target", "none"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    process.stdout.close()  # before the interpreter has even imported the service
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 141, stderr
    assert stderr == b""


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
    out = run("precompile", "--require-proof", "--target", "cuda:90", "--cache-dir", str(cache))
    assert out.returncode == 0, out.stderr
    for n in (1, 2, 3):
        assert f"precompile {n}/3 key=" in out.stderr
    assert "precompile done keys=3 failed=0 unproved=0" in out.stderr and str(cache) in out.stderr
    assert out.stderr.count("source=compiler proof=ok") == 3
    assert len(list(cache.rglob("*.cubin"))) == 3
    # Again on the same cache: every key is loaded from it, and says so.
    again = run("precompile", "--require-proof", "--target", "cuda:90", "--cache-dir", str(cache))
    assert again.returncode == 0 and again.stderr.count("source=cache proof=ok") == 3, again.stderr


# The CLI with every proof unavailable, as Triton 3.6's interpreter is with numpy 2.4 (the image's lock pairs
# them no more: requirements/image.in).
WITHOUT_PROOFS = (
    "import sys\n"
    "from indexer_service.kernels import compile_engine\n"
    "def unavailable(key, *, on_gpu):\n"
    "    raise compile_engine.ProofUnavailableError('this interpreter cannot run here (test)')\n"
    "compile_engine.prove_key = unavailable\n"
    "from indexer_service.service.process.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_precompile_require_proof_fails_when_a_proof_cannot_run(tmp_path: Path) -> None:
    """Without --require-proof a skipped proof is a warning (the keys compiled); with it, the command fails: the
    image build passes it, so an image whose keys were never proved cannot be built."""
    argv = [sys.executable, "-c", WITHOUT_PROOFS, "precompile", "--target", "cuda:90", "--cache-dir", str(tmp_path)]
    lenient = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=clean_env())
    assert lenient.returncode == 0, lenient.stderr
    assert lenient.stderr.count("proof=skipped") == 3 and "unproved=3" in lenient.stderr
    strict = subprocess.run([*argv, "--require-proof"], capture_output=True, text=True, timeout=120, env=clean_env())
    assert strict.returncode == 1, strict.stderr
    assert "precompile failed keys=3 failed=0 unproved=3" in strict.stderr
    assert "--require-proof: 3 keys compiled but could not be proved here" in strict.stderr


def test_precompile_exits_nonzero_when_a_key_fails(tmp_path: Path) -> None:
    out = run("precompile", "--target", "cuda:1", "--cache-dir", str(tmp_path / "cache"))
    assert out.returncode == 1
    assert "precompile failed keys=3 failed=3" in out.stderr and "sm_1" in out.stderr


def test_check_a_serving_server(live_server: ServiceProcess) -> None:
    out = run("check", live_server.address)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"reached address={live_server.address} port=rpc: ")
    assert lines[1] == "health overall=SERVING indexer.v1.PrefillMetadata=SERVING"
    backend, target = default_backend_and_target()
    # Compiled by its warmup, or loaded from the session's Triton cache where an earlier server filled it.
    summary = re.match(
        rf"warmup state=READY ready=true backend={backend} target={target} strict=false keys=3 "
        r"compiled=(\d) cached=(\d) failed=0 ",
        lines[2],
    )
    assert summary and int(summary[1]) + int(summary[2]) == 3, lines[2]
    assert [line.split()[1] for line in lines[3:]] == [
        "r1-b1024-aligned-i32",
        "r4-b1024-aligned-i32",
        "r128-b1024-aligned-i32",
    ]
    states = [line.split()[2] for line in lines[3:]]
    assert states.count("state=COMPILED") == int(summary[1]) and states.count("state=CACHED") == int(summary[2])


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
    assert out.returncode == 3 and "unreachable" in out.stdout and "UNAVAILABLE" in out.stdout


@pytest.mark.parametrize(
    ("address", "example"),
    [
        ("127.0.0.1", "127.0.0.1:50051"),
        ("localhost:", "localhost:50051"),
        ("[::1]", "[::1]:50051"),
        ("dns:///indexer-headless", "dns:///indexer-headless:50051"),
    ],
)
def test_check_without_a_port_says_a_port_is_needed(address: str, example: str) -> None:
    """Before: gRPC took port 443 and check said only "unreachable" (or reached whatever listens there)."""
    from indexer_service.service.process.cli import main as cli_main

    out = run("check", address, timeout=60)
    assert out.returncode == 2 and not out.stdout, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and f"address {address!r} has no port: a port is needed" in out.stderr
    assert "grpc_port, 50051 by default" in out.stderr and f"e.g. {example}" in out.stderr, out.stderr
    assert cli_main(["check", address]) == 2


def test_check_on_an_http_port_says_it_is_http(live_server: ServiceProcess) -> None:
    """Both HTTP ports: unreachable over gRPC (3), and a line that says the port speaks HTTP/1.x, with its status
    line, and where the gRPC port is."""
    for port in (live_server.http_port, live_server.http_rpc_port):
        out = run("check", f"{LOOPBACK}:{port}", "--timeout", "3", timeout=60)
        assert out.returncode == 3, out.stdout + out.stderr
        first, second = out.stdout.splitlines()
        assert first.startswith(f"unreachable address={LOOPBACK}:{port} code=UNAVAILABLE")
        assert second.startswith("http: this port speaks HTTP/1.x, not gRPC (it answered 'HTTP/1.1 400 "), second
        assert "http_port (8080 by default" in second and "check the RPC port (grpc_port, 50051 by default)" in second


@pytest.fixture(scope="module")
def pem(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    import trustme

    folder = tmp_path_factory.mktemp("pem")
    ca = trustme.CA()
    client = ca.issue_cert("scheduler@example.org")
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    client.cert_chain_pems[0].write_to_path(str(folder / "cert.pem"))
    client.private_key_pem.write_to_path(str(folder / "key.pem"))
    (folder / "junk.pem").write_text("not PEM\n")
    (folder / "config.toml").write_text("grpc_port = 1\n")
    return {p.stem: str(p) for p in folder.iterdir()}


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--tls-ca", "/missing.pem"), "--tls-ca: cannot read /missing.pem"),
        (("--tls-ca", "{junk}"), "is not a PEM file"),
        (("--tls-cert", "{cert}"), "--tls-cert and --tls-key go together"),
        (("--tls-key", "{key}"), "--tls-cert and --tls-key go together"),
        (("--timeout", "-1"), "--timeout"),
        (("--timeout", "inf"), "--timeout"),
    ],
)
def test_check_usage_errors_exit_2_with_one_line(args: tuple[str, ...], fragment: str, pem: dict) -> None:
    """A usage error is not "not serving" (1) nor "unreachable" (3); nothing is called."""
    from indexer_service.service.process.cli import main as cli_main

    argv = ["check", f"{LOOPBACK}:1", *(a.format(**pem) for a in args)]
    out = run(*argv, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and fragment in out.stderr and not out.stdout, out.stderr
    assert cli_main(argv) == 2  # in-process too


def test_check_takes_no_server_settings(pem: dict) -> None:
    out = run("check", f"{LOOPBACK}:1", "--config", pem["config"], timeout=60)
    assert out.returncode == 2 and "unrecognized arguments: --config" in out.stderr


def test_check_with_a_client_certificate_but_no_ca_speaks_tls(live_server: ServiceProcess, pem: dict) -> None:
    """Before: --tls-cert and --tls-key without --tls-ca were dropped and check went plaintext (exit 0). Any
    --tls* flag turns TLS on (system roots without --tls-ca): against this plaintext server the handshake
    fails, which is unreachable (3)."""
    for extra in (("--tls-cert", pem["cert"], "--tls-key", pem["key"]), ("--tls",), ("--tls-ca", pem["ca"])):
        out = run("check", live_server.address, "--timeout", "3", *extra, timeout=60)
        assert out.returncode == 3 and out.stdout.startswith("unreachable"), (extra, out.stdout, out.stderr)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--max-connection-age-seconds", "inf"), "max_connection_age_seconds (from flag --max-connection-age-seconds"),
        (("--max-connection-age-seconds", "1e12"), "max_connection_age_seconds (from flag"),
        (("--compress-ratios", "1099511627776"), "compress_ratios (from flag --compress-ratios)"),
        (("--model-config", "{deep}"), "model_config (from flag --model-config): cannot read"),
        (("--model-config", "{no_ratios}"), "no compress_ratios"),
        (("--tls-cert-file", "{junk}", "--tls-key-file", "{junk}"), "tls_cert_file (from flag --tls-cert-file)"),
        (("--tls-cert-file", "{cert}"), "tls_key_file: not set, but tls_cert_file is (flag --tls-cert-file)"),
    ],
)
def test_invalid_values_from_the_issue_exit_2_with_one_line(
    args: tuple[str, ...], fragment: str, pem: dict, tmp_path: Path
) -> None:
    """The real executable, as the issue ran it: one stderr line, exit 2, never a traceback."""
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "no_ratios.json").write_text(json.dumps({"compress_ratio": [4, 128]}))
    files = pem | {"deep": str(tmp_path / "deep.json"), "no_ratios": str(tmp_path / "no_ratios.json")}
    out = run("serve", "--warmup-target", "none", *(a.format(**files) for a in args), timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("indexer-service serve: invalid config: ") and fragment in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--target", "sm90", "--cache-dir", "{tmp}"), "warmup_target (from flag --target)"),
        (("--target", "none", "--cache-dir", "{tmp}"), "warmup_target (from flag --target): precompile needs"),
        (("--warmup-target", "none"), "warmup_target (from flag --warmup-target)"),
        (("--target", "cuda:90", "--cache-dir", "{file}/cache"), "triton_cache_dir (from flag --cache-dir)"),
    ],
)
def test_errors_through_an_alias_name_the_alias(args: tuple[str, ...], fragment: str, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    out = run("precompile", *(a.format(tmp=tmp_path, file=tmp_path / "file") for a in args), timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and fragment in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("args", "env", "fragment"),
    [
        (("--grpc-port", "70000"), {}, "grpc_port (from flag --grpc-port): must be in [0, 65535]"),
        ((), {"INDEXER_MAX_NUM_SEQS": "many"}, "max_num_seqs (from env INDEXER_MAX_NUM_SEQS)"),
        (("--model-config", "/nonexistent/config.json"), {}, "model_config"),
        pytest.param(
            ("--backend", "triton"),
            {},
            "backend",
            marks=pytest.mark.skipif(
                cuda_available(), reason="this machine has CUDA: the Triton backend is a valid choice here"
            ),
        ),
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
        out = run(
            "serve",
            "--backend",
            "numpy",
            "--warmup-target",
            "none",
            *listen_flags(grpc_port=port),
            timeout=60,
        )
    assert out.returncode == 1 and f"cannot bind gRPC to {LOOPBACK}:{port}" in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("indexer-service serve:")]
    assert len(errors) == 1 and "cannot bind gRPC" in errors[0] and "Traceback" not in out.stderr, out.stderr
