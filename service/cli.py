"""``indexer-service``: serve, keys, precompile, check."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import grpc

from service.config import (
    NO_WARMUP,
    ConfigError,
    ServiceConfig,
    add_config_arguments,
    config_from_arguments,
    configure_logging,
)

log = logging.getLogger("service.cli")

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _configure(args: argparse.Namespace) -> ServiceConfig:
    config = config_from_arguments(args)
    configure_logging(config.log_level)
    return config


def _serve(args: argparse.Namespace) -> int:
    from service.server import serve

    return serve(_configure(args), args.port_file)


def _keys(args: argparse.Namespace) -> int:
    from kernels.specialization import warmup_keys

    for key in warmup_keys(_configure(args).model):
        print(key.to_json())
    return EXIT_OK


def _precompile(args: argparse.Namespace) -> int:
    from kernels.specialization import warmup_keys
    from service.warmup import compile_and_log, use_triton_cache_dir

    config = _configure(args)
    if not config.warmup_enabled:
        raise ConfigError("warmup_target", f"precompile needs a target such as cuda:90, got {NO_WARMUP!r}")
    cache_dir = use_triton_cache_dir(config.triton_cache_dir)
    keys = warmup_keys(config.model)
    log.info("precompile start keys=%d target=%s cache_dir=%s", len(keys), config.warmup_target,
             cache_dir or "(Triton's default)")  # fmt: skip
    start = time.perf_counter()
    outcomes = compile_and_log(keys, config.warmup_target, config.warmup_workers, "precompile")
    failed = sum(not o.ok for o in outcomes)
    log.log(logging.ERROR if failed else logging.INFO, "precompile %s keys=%d failed=%d seconds=%.3f cache_dir=%s",
            "failed" if failed else "done", len(keys), failed, time.perf_counter() - start,
            cache_dir or "(Triton's default)")  # fmt: skip
    return EXIT_FAILED if failed else EXIT_OK


def _check(args: argparse.Namespace) -> int:
    from protos.indexer.v1 import indexer_pb2 as pb
    from service.client import IndexerClient, tls_credentials
    from service.codec import SERVICE_NAME

    credentials = tls_credentials(args.tls_ca, args.tls_cert, args.tls_key) if args.tls_ca else None
    # No client-side health check (a server that is not SERVING must still answer) and one attempt: the
    # answer is about this server now.
    with IndexerClient(
        args.address, timeout=args.timeout, max_attempts=1, health_check=False, credentials=credentials
    ) as client:
        try:
            overall, service = client.health(""), client.health(SERVICE_NAME)
            status = client.warmup_status()
        except grpc.RpcError as exc:
            print(f"unreachable address={args.address} code={exc.code().name} details={exc.details()!r}")
            return EXIT_USAGE
    print(f"health overall={overall} {SERVICE_NAME}={service}")
    states = [pb.KeyState.Name(k.state).removeprefix("KEY_STATE_") for k in status.keys]
    print(
        f"warmup state={pb.WarmupState.Name(status.state).removeprefix('WARMUP_STATE_')} "
        f"ready={str(status.ready).lower()} backend={status.backend} target={status.target} "
        f"strict={str(status.strict).lower()} keys={len(status.keys)} compiled={states.count('COMPILED')} "
        f"failed={states.count('FAILED')} seconds={status.warmup_seconds:.3f} "
        f"compiles_after_ready={status.compiles_after_ready}"
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
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve", help="run the server (gRPC and HTTP)",
        description="Start the gRPC and HTTP servers, warm up, serve until SIGTERM, then drain and exit 0.",
    )  # fmt: skip
    add_config_arguments(serve)
    serve.add_argument("--port-file", type=Path, metavar="PATH",
                       help="write the bound ports as JSON here once both listeners are up")  # fmt: skip
    serve.set_defaults(run=_serve)

    keys = commands.add_parser(
        "keys", help="print the normalised warmup set, one JSON object a line",
        description="Print every compile key of the configured model's warmup set (every axis), one JSON a line.",
    )  # fmt: skip
    add_config_arguments(keys)
    keys.set_defaults(run=_keys)

    precompile = commands.add_parser(
        "precompile", help="fill a Triton cache ahead of time, without serving",
        description="Compile the warmup set for --target into --cache-dir, with no GPU needed; exit 1 if any "
        "key fails.",
    )  # fmt: skip
    add_config_arguments(precompile, aliases={"warmup_target": "--target", "triton_cache_dir": "--cache-dir"})
    precompile.set_defaults(run=_precompile)

    check = commands.add_parser(
        "check", help="ask a running server for its health and warmup status",
        description="Call a running server once; print its health and warmup status. Exit 0 when serving, 1 when "
        "not serving, 2 when unreachable.",
    )  # fmt: skip
    check.add_argument("address", help="host:port of the gRPC server")
    check.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="deadline of each call")
    check.add_argument("--tls-ca", metavar="PEM", help="connect with TLS, trusting this CA bundle")
    check.add_argument("--tls-cert", metavar="PEM", help="client certificate, for a server that requires mTLS")
    check.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    check.set_defaults(run=_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as exc:
        print(f"indexer-service {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"indexer-service {args.command}: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
