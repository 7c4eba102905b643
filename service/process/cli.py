"""``indexer-service``: serve, keys, precompile, check."""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import signal
import socket
import ssl
import sys
import time
from pathlib import Path

from indexer_service.service.config import ConfigError, ServiceConfig, unknown_environment
from indexer_service.service.observability.logs import configure_logging, error_line
from indexer_service.service.observability.version import version_line
from indexer_service.service.process.addresses import TARGET_SCHEMES, split_host_port
from indexer_service.service.process.flags import add_config_arguments, config_from_arguments, requested_log_format

log = logging.getLogger(__name__)

# check: 0 serving, 1 not serving, 2 usage or configuration error, 3 unreachable. serve, keys, precompile:
# 0 done, 1 failed (a fatal start-up error, a failed compile), 2 usage or configuration error.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


class UsageError(ValueError):
    """A command-line mistake outside the settings (a check flag): exit 2, one line."""


def _configure(args: argparse.Namespace, needs_warmup: str = "") -> ServiceConfig:
    config = config_from_arguments(args, needs_warmup)
    configure_logging(config.log_level, config.log_format)
    for variable, closest in unknown_environment().items():
        hint = f"; did you mean {closest}?" if closest else ""
        log.warning("unknown environment variable=%s ignored%s", variable, hint)
    return config


def _serve(args: argparse.Namespace) -> int:
    from indexer_service.service.process.lifecycle import ShutdownSignals, end_process

    # Signals first: from here on SIGTERM, SIGINT or SIGHUP ends the process with 0, whatever it is doing.
    signals = ShutdownSignals()
    try:
        config = _configure(args)
        if config.warmup_enabled and config.workers == 1:
            # Triton loads, and hashes its installation (its cache's key), beside the rest of the start from here:
            # on the critical path of a CPU start, begun as early as the configuration says it is needed.
            from indexer_service.service.compute.warmup import preload_compiler

            preload_compiler()
        from indexer_service.service.observability.tracing import exporter_entry_points

        exporter_entry_points()  # an OTEL_* mistake stops the start with exit 2, one worker or several
    except BaseException:
        signals.close()
        raise
    try:
        # Each library's features are probed, and its fallbacks announced, with the start line (announce_start):
        # in a supervisor, once its multiprocess directory is named (service/adapters/prometheus.py says why).
        from indexer_service.service.process.supervisor import resolve_workers

        workers, source = resolve_workers(config.workers)
        if workers > 1:  # the supervisor and its workers (service/process/supervisor.py); 1: this process serves
            from indexer_service.service.process.supervisor import supervise

            code = supervise(config, workers, source, args.port_file, signals)
        else:
            if config.warmup_enabled:  # workers = 0 (auto) that came to 1: not preloaded above
                from indexer_service.service.compute.warmup import preload_compiler

                preload_compiler()
            from indexer_service.service.process.server import serve

            code = serve(config, args.port_file, signals)
    except ConfigError as exc:  # found only once the server is built (none should be)
        print(_error(args, "config_error", exc, setting=exc.setting, source=exc.source), file=sys.stderr)
        code = EXIT_USAGE
    except (OSError, RuntimeError) as exc:  # a fatal start-up error: grpcio, bind, port file, the HTTP server
        log.error("fatal %s", exc)
        if config.log_format != "json":  # the log line above is the JSON log's whole account
            print(f"indexer-service serve: {exc}", file=sys.stderr)
        code = EXIT_FAILED
    except BaseException:
        log.exception("fatal internal error")
        code = EXIT_FAILED
    # Never a normal interpreter exit once the server may have started: service/process/lifecycle.py says why.
    end_process(code)
    return code  # not reached


def _keys(args: argparse.Namespace) -> int:
    from indexer_service.kernels.specialization import warmup_keys

    for key in warmup_keys(_configure(args).model):
        print(key.to_json())
    return EXIT_OK


def _precompile(args: argparse.Namespace) -> int:
    from indexer_service.kernels.compile_engine import PROOF_SKIPPED
    from indexer_service.kernels.specialization import warmup_keys
    from indexer_service.service.adapters import probe_all
    from indexer_service.service.compute.warmup import compile_and_log, use_triton_cache_dir

    config = _configure(args, needs_warmup="precompile")
    probe_all(triton=True)  # Triton's fallbacks, announced before the compiles that take them
    cache_dir = use_triton_cache_dir(config.triton_cache_dir)
    keys = warmup_keys(config.model)
    log.info(
        "precompile start keys=%d target=%s cache_dir=%s",
        len(keys),
        config.warmup_target,
        cache_dir or "(Triton's default)",
    )
    start = time.perf_counter()
    outcomes = compile_and_log(keys, keys, config.warmup_target, config.warmup_workers, "precompile")
    failed = sum(not o.ok for o in outcomes)
    unproved = sum(o.ok and o.proof == PROOF_SKIPPED for o in outcomes)
    refused = failed or (unproved and args.require_proof)
    log.log(
        logging.ERROR if refused else logging.INFO,
        "precompile %s keys=%d failed=%d unproved=%d seconds=%.3f cache_dir=%s",
        "failed" if refused else "done",
        len(keys),
        failed,
        unproved,
        time.perf_counter() - start,
        cache_dir or "(Triton's default)",
    )
    if unproved and args.require_proof:
        log.error("precompile --require-proof: %d keys compiled but could not be proved here", unproved)
    return EXIT_FAILED if refused else EXIT_OK


def _check_credentials(args: argparse.Namespace) -> object:
    """None (plaintext), or TLS credentials: any --tls* flag turns TLS on; without --tls-ca the server's
    certificate must chain to the system's trusted roots."""
    from indexer_service.client import tls_credentials

    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together (a client certificate and its key)")
    if not (args.tls or args.tls_ca or args.tls_cert):
        return None
    for option, path in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path is None:
            continue
        try:
            text = Path(path).read_bytes()
        except OSError as exc:
            raise UsageError(f"{option}: cannot read {path}: {exc.strerror or exc}") from None
        if b"-----BEGIN " not in text:
            raise UsageError(f"{option}: {path} is not a PEM file")
    return tls_credentials(args.tls_ca, args.tls_cert, args.tls_key)


def tls_diagnosis(args: argparse.Namespace, credentials: object) -> str | None:
    """Why a connection failed, where a TLS handshake of this process's own can tell (gRPC says only "Socket
    closed" or an OpenSSL code): TLS spoken to a plaintext port, plaintext to a TLS port, a server certificate
    that does not chain to the CA given, a server that wants a client certificate. None when the handshake
    tells nothing (the port is closed, say)."""
    try:
        where = split_host_port(args.address)
    except ValueError:  # another gRPC target (dns:///...): no one socket to try
        return None
    use_tls = credentials is not None
    if use_tls:
        context = ssl.create_default_context(cafile=args.tls_ca)
        if args.tls_cert:
            context.load_cert_chain(args.tls_cert, args.tls_key)
    else:  # only to learn whether the port speaks TLS: nothing is sent over this connection
        context = ssl._create_unverified_context()
    context.set_alpn_protocols(["h2"])
    timeout = min(args.timeout, 3.0)
    try:
        with (
            socket.create_connection(where, timeout=timeout) as raw,
            context.wrap_socket(raw, server_hostname=where[0]) as tls,
        ):
            tls.settimeout(min(timeout, 1.0))
            try:
                # A gRPC server speaks first (its HTTP/2 settings); one that requires a client certificate
                # closes the connection instead once the handshake is over (TLS 1.3 checks it last).
                closed = tls.recv(1) == b""
            except TimeoutError:
                closed = False
    except ssl.SSLCertVerificationError as exc:
        trusted = f"--tls-ca {args.tls_ca}" if args.tls_ca else "the system's trusted roots (give --tls-ca PEM)"
        return f"the server's certificate does not chain to {trusted}: {exc.verify_message}"
    except ssl.SSLError as exc:
        if exc.reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"):
            return "this port does not speak TLS (plaintext): drop the --tls* flags, or turn TLS on in the server"
        return f"TLS handshake failed: {exc.reason or exc}"
    except OSError:
        return None
    if not use_tls:
        return "this port speaks TLS: connect with --tls-ca PEM (its certificate's CA), or --tls for the system's roots"
    if closed and not args.tls_cert:
        return (
            "the server closed the connection after the TLS handshake, as one that requires a client certificate "
            "(mutual TLS) does: give --tls-cert PEM --tls-key PEM"
        )
    if closed:
        return "the server closed the connection after the TLS handshake: is the client certificate signed by its CA?"
    return None


# What a client sends first on an HTTP/2 connection (RFC 9113, 3.4): the preface and an empty SETTINGS frame.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_RPC_PORT_DEFAULT = "the RPC port (grpc_port, 50051 by default)"


def _check_address(address: str) -> None:
    """A usage error for an address without a port, which gRPC would take as port 443 (and report unreachable, or
    reach another service), or not a ``host:port`` at all (an IPv6 literal without brackets, a port out of range).
    Targets with another scheme than ``dns:`` are gRPC's to read."""
    if not address.strip():
        raise UsageError("address: must not be empty")
    if address.startswith("dns:"):
        name = address.removeprefix("dns:").rsplit("/", 1)[-1]  # dns:///name:port, dns://server/name:port
    elif address.startswith(TARGET_SCHEMES):
        return
    else:
        name = address
    if name.startswith("["):  # [v6]:port
        port = name.partition("]")[2].removeprefix(":")
    else:
        port = name.rpartition(":")[2] if ":" in name else ""
    if not port:
        raise UsageError(
            f"address {address!r} has no port: a port is needed, {_RPC_PORT_DEFAULT}, e.g. {address.rstrip(':')}:50051"
        )
    try:
        split_host_port(name)
    except ValueError as exc:
        raise UsageError(f"address: {exc}") from None


def http_diagnosis(args: argparse.Namespace) -> str | None:
    """The status line a plaintext port answers to an HTTP/2 connection preface when it speaks HTTP/1.x (one of
    the server's HTTP ports, or another HTTP server), where gRPC says only that the connection failed; None when
    it does not (a gRPC server answers with binary frames) or cannot be asked."""
    try:
        where = split_host_port(args.address)
    except ValueError:  # another gRPC target (dns:///...): no one socket to try
        return None
    try:
        with socket.create_connection(where, timeout=min(args.timeout, 3.0)) as connection:
            connection.sendall(_H2_PREFACE)
            answer = connection.recv(256)
    except OSError:
        return None
    if not answer.startswith(b"HTTP/"):
        return None
    return answer.split(b"\r\n", 1)[0].decode("ascii", "replace")


def _check(args: argparse.Namespace) -> int:
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise UsageError(f"--timeout: must be a finite number of seconds > 0, got {args.timeout}")
    _check_address(args.address)
    # gRPC core's own handshake log lines (INFO) would repeat, less clearly, what the diagnosis below says; set
    # before grpc is first imported (the credentials import it).
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    credentials = _check_credentials(args)

    import grpc

    from indexer_service.client import IndexerClient
    from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
    from indexer_service.service.codec import SERVICE_NAME

    # No client-side health check (a server that is not SERVING must still answer), one attempt and no
    # waiting for a ready server: the answer is about this server now.
    with IndexerClient(
        args.address,
        timeout=args.timeout,
        max_attempts=1,
        health_check=False,
        wait_for_ready=False,
        credentials=credentials,
        connections=1,
    ) as client:
        try:
            overall, service = client.health(""), client.health(SERVICE_NAME)
        except grpc.RpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                print(f"unreachable address={args.address} code={code.name} details={exc.details()!r}")
                if code is not grpc.StatusCode.UNAVAILABLE:
                    return EXIT_UNREACHABLE
                if credentials is None and (status_line := http_diagnosis(args)) is not None:
                    print(
                        f"http: this port speaks HTTP/1.x, not gRPC (it answered {status_line!r}): an HTTP port, such "
                        "as http_port (8080 by default: /metrics, /livez, /readyz) or http_rpc_port (8081: the RPCs "
                        f"over HTTP); check {_RPC_PORT_DEFAULT}"
                    )
                elif (why := tls_diagnosis(args, credentials)) is not None:
                    print(f"tls: {why}")
                return EXIT_UNREACHABLE
            # Answered, but not as an indexer-service port (another service, refused credentials, ...).
            print(f"not an indexer-service port address={args.address} code={code.name} details={exc.details()!r}")
            return EXIT_FAILED
        try:
            status, refusal = client.warmup_status(), ""
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.UNIMPLEMENTED:
                print(f"not serving address={args.address} code={exc.code().name} details={exc.details()!r}")
                return EXIT_FAILED
            status, refusal = None, exc.details() or ""
    if status is None:
        # The health port names the RPC port it belongs to in its refusal ("... on port 50051").
        named = re.search(r"\bon port (\d+)", refusal)
        rpc_port = f"the RPC port (grpc_port: {named[1]} on this server)" if named else _RPC_PORT_DEFAULT
        print(
            f"reached address={args.address} port=health-only: it serves grpc.health.v1 alone, for probes "
            f"(health_port, 50052 by default); the RPCs and the warmup status are on {rpc_port}"
        )
        print(f"health overall={overall} {SERVICE_NAME}={service}")
        return EXIT_OK if service == "SERVING" else EXIT_FAILED
    print(f"reached address={args.address} port=rpc: {SERVICE_NAME}, grpc.health.v1 and reflection")
    print(f"health overall={overall} {SERVICE_NAME}={service}")
    states = [pb.KeyState.Name(k.state).removeprefix("KEY_STATE_") for k in status.keys]
    print(
        f"warmup state={pb.WarmupState.Name(status.state).removeprefix('WARMUP_STATE_')} "
        f"ready={str(status.ready).lower()} backend={status.backend} target={status.target} "
        f"strict={str(status.strict).lower()} keys={len(status.keys)} compiled={states.count('COMPILED')} "
        f"cached={states.count('CACHED')} failed={states.count('FAILED')} seconds={status.warmup_seconds:.3f} "
        f"compiles_after_ready={status.compiles_after_ready} server_version={status.server_version or '-'}"
    )
    for key, state in zip(status.keys, states, strict=True):
        error = f" error={key.error!r}" if key.error else ""
        print(f"key {key.label} state={state} seconds={key.compile_seconds:.3f}{error}")
    return EXIT_OK if service == "SERVING" else EXIT_FAILED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="indexer-service",
        description="DeepSeek-V4 sparse-indexer prefill chunk metadata over gRPC, with warmup-gated readiness.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version_line()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the server (gRPC and HTTP)",
        description="Start the gRPC and HTTP servers, warm up, serve until SIGTERM, then drain and exit 0.",
    )
    serve.add_argument("--version", action="version", version=f"indexer-service {version_line()}")
    add_config_arguments(serve)
    serve.add_argument(
        "--port-file", type=Path, metavar="PATH", help="write the bound ports as JSON here once every listener is up"
    )
    serve.set_defaults(run=_serve)

    keys = commands.add_parser(
        "keys",
        help="print the normalised warmup set, one JSON object a line",
        description="Print every compile key of the configured model's warmup set (every axis), one JSON a line.",
    )
    add_config_arguments(keys)
    keys.set_defaults(run=_keys)

    precompile = commands.add_parser(
        "precompile",
        help="fill a Triton cache ahead of time, without serving",
        description="Compile the warmup set for --target into --cache-dir, with no GPU needed; exit 1 if any "
        "key fails.",
    )
    add_config_arguments(precompile, aliases={"warmup_target": "--target", "triton_cache_dir": "--cache-dir"})
    precompile.add_argument(
        "--require-proof",
        action="store_true",
        help="exit 1 also when a key's proof (one launch checked against numpy) cannot run here, as when this "
        "Triton's interpreter cannot run with this numpy",
    )
    precompile.set_defaults(run=_precompile)

    check = commands.add_parser(
        "check",
        help="ask a running server for its health and warmup status",
        description="Call a running server once; print its health and warmup status. Exit 0 when serving, 1 when "
        "not serving (or answering as something else), 2 on a usage error (a bad flag, an address without a port, "
        "an unreadable --tls-* file), 3 when unreachable (connection refused, TLS handshake failed, an HTTP port, "
        "no answer within --timeout). "
        "Takes only the flags below, not the server's settings. Any --tls* flag turns TLS on; the server's "
        "certificate must then chain to --tls-ca, or to the system's trusted roots without it.",
    )
    check.add_argument(
        "address", help="host:port of the gRPC server's RPC port (or a gRPC target such as dns:///name:port)"
    )
    check.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="deadline of each call")
    check.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's roots")
    check.add_argument("--tls-ca", metavar="PEM", help="connect with TLS, trusting this CA bundle")
    check.add_argument(
        "--tls-cert",
        metavar="PEM",
        help="client certificate (TLS on), for a server that requires mutual TLS; needs --tls-key",
    )
    check.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    check.set_defaults(run=_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.run(args)
        sys.stdout.flush()  # a pipe's buffered output fails here, inside the handler, not at interpreter exit
        return code
    except BrokenPipeError:
        # The reader went away (`keys | head`): not this command's failure. Quiet, and the exit a process
        # killed by SIGPIPE has, as other command-line tools do; stdout goes to /dev/null so that the
        # interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (ConfigError, UsageError) as exc:
        setting = exc.setting if isinstance(exc, ConfigError) else None
        source = exc.source if isinstance(exc, ConfigError) else None
        print(_error(args, "config_error", exc, setting=setting, source=source), file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(_error(args, "fatal", exc), file=sys.stderr)
        return EXIT_FAILED


def _error(args: argparse.Namespace, event: str, exc: BaseException, **fields: object) -> str:
    """The one stderr line of a command that failed before or without its log: ``indexer-service CMD: ...``, or
    under JSON logs (the flag, the environment, or the config file says so) a JSON line of the log's shape."""
    return error_line(requested_log_format(args), __name__, event, f"indexer-service {args.command}: {exc}", **fields)


if __name__ == "__main__":
    sys.exit(main())
