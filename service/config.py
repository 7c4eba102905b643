"""The service's one configuration object and where its values come from.

Every setting has one name used by all layers: the key in a TOML file, ``INDEXER_<NAME>`` in the environment,
``--<name-with-dashes>`` on the command line. Layers, lowest first: the embedded ``default_config.toml`` (the
only place defaults live), ``--config PATH``, the environment, the flags. Any invalid value stops the start
with a :class:`ConfigError` naming the setting and where the value came from.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path

from kernels.specialization import ModelConfig

ENV_PREFIX = "INDEXER_"
CONFIG_FILE_ENV = ENV_PREFIX + "CONFIG"
BACKENDS = ("auto", "numpy", "triton")
NO_WARMUP = "none"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_INT32_MAX = 2**31 - 1


def _setting(help_text: str) -> object:
    return field(metadata={"help": help_text})


@dataclass(frozen=True)
class ServiceConfig:
    grpc_host: str = _setting("address the gRPC server binds")
    grpc_port: int = _setting("gRPC port (0: any free port)")
    http_host: str = _setting("address the HTTP server (/metrics, /livez, /readyz) binds")
    http_port: int = _setting("HTTP port (0: any free port)")
    grpc_workers: int = _setting("threads of the gRPC server")
    max_message_bytes: int = _setting("largest gRPC message or HTTP body, either way, in bytes")
    max_concurrent_rpcs: int = _setting("most RPCs handled at once; more get RESOURCE_EXHAUSTED")
    max_connection_age_seconds: float = _setting("seconds before a client is asked to reconnect (0: never)")
    max_streams_per_connection: int = _setting("most concurrent HTTP/2 streams (calls) on one gRPC connection")
    health_port: int = _setting("plaintext gRPC port serving only grpc.health.v1, for probes (0: any free port)")
    tls_cert_file: str = _setting("PEM certificate chain of the gRPC port (with tls_key_file: TLS on)")
    tls_key_file: str = _setting("PEM private key of tls_cert_file")
    tls_client_ca_file: str = _setting("PEM CA bundle that client certificates must chain to (mutual TLS)")
    shutdown_grace_seconds: float = _setting("seconds in-flight calls get to finish on SIGTERM")
    shutdown_delay_seconds: float = _setting("seconds to keep serving while NOT_SERVING before refusing new calls")
    compress_ratios: tuple[int, ...] = _setting("per-layer compress ratios, comma-separated (0 means 1)")
    index_kpool: int = _setting("kpool indexer compress ratio (0: absent)")
    model_config: str = _setting("Hugging Face config.json to read compress_ratios and index_kpool from")
    max_num_batched_tokens: int = _setting("most query tokens in one request's batch")
    max_num_seqs: int = _setting("most sequences in one request's batch")
    max_model_len: int = _setting("longest sequence; also sizes the chunk KV workspace")
    max_logits_bytes: int = _setting("default logits budget of a planned chunk, in bytes")
    max_plan_chunks: int = _setting("most chunks in one PlanBatch plan; more is RESOURCE_EXHAUSTED")
    response_budget_bytes: int = _setting(
        "bytes of responses held at once (built, queued or unsent); 0: min(256 MiB, memory limit / 8)"
    )
    response_drain_seconds: float = _setting("seconds a caller has to read its response before it is cancelled")
    heavy_request_bytes: int = _setting("estimated cost in bytes above which a request takes the heavy lane")
    heavy_lane_slots: int = _setting("heavy requests computed at once")
    admission_wait_seconds: float = _setting("longest wait for the response budget or a heavy-lane slot")
    http_max_header_bytes: int = _setting("largest HTTP request head (request line and headers), in bytes")
    http_idle_timeout_seconds: float = _setting("seconds an HTTP connection may sit with no request in progress")
    http_max_connections: int = _setting("most open HTTP connections; more are refused")
    idle_trim_seconds: float = _setting("seconds with no call in flight before free heap returns to the OS (0: never)")
    backend: str = _setting("compute backend: auto (Triton on a CUDA GPU, else numpy), numpy or triton")
    warmup_target: str = _setting("ahead-of-time warmup target without GPU (cuda:90, hip:gfx942) or none")
    warmup_workers: int = _setting("parallel compiles during warmup")
    strict: bool = _setting("refuse launches that need a kernel variant outside the warmed set")
    native_fast_path: bool = _setting("serve plain BuildChunk requests in compiled C when the backend is numpy")
    triton_cache_dir: str = _setting("Triton cache directory (an existing TRITON_CACHE_DIR wins)")
    malloc_arena_max: int = _setting("most glibc malloc arenas (0: glibc's default)")
    malloc_retain_bytes: int = _setting("freed memory glibc keeps per arena for reuse (0: glibc's default)")
    log_level: str = _setting("DEBUG, INFO, WARNING or ERROR")

    @property
    def model(self) -> ModelConfig:
        return ModelConfig(self.compress_ratios, self.index_kpool or None)

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls_cert_file)

    @property
    def warmup_enabled(self) -> bool:
        return self.warmup_target != NO_WARMUP

    def summary(self) -> str:
        """One log line: every setting, the long ratio list as its distinct values."""
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "compress_ratios":
                value = ",".join(str(r) for r in dict.fromkeys(value)) + f" ({len(value)} layers)"
            parts.append(f"{f.name}={value}")
        return " ".join(parts)


SETTINGS = {f.name: f for f in fields(ServiceConfig)}


class ConfigError(ValueError):
    """An invalid setting; ``setting`` names it, ``source`` says where its value came from."""

    def __init__(self, setting: str, message: str, source: str | None = None) -> None:
        self.setting = setting
        self.source = source
        where = f" (from {source})" if source else ""
        super().__init__(f"invalid config: {setting}{where}: {message}")


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _coerce(name: str, value: object, source: str) -> object:
    """A value from TOML (typed) or from the environment or a flag (text) as the setting's type."""
    kind = SETTINGS[name].type
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text not in _TRUE | _FALSE:
                raise ValueError(f"expected true or false, got {value!r}")
            return text in _TRUE
        if kind == "int":
            if isinstance(value, bool | float):
                raise ValueError(f"expected an integer, got {value!r}")
            return int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError(f"expected a number, got {value!r}")
            return float(value)
        if kind == "tuple[int, ...]":
            items = value if isinstance(value, list) else [v for v in str(value).split(",") if v.strip()]
            if any(isinstance(v, bool | float) for v in items):
                raise ValueError(f"expected integers, got {value!r}")
            return tuple(int(v) for v in items)
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
        return value
    except (TypeError, ValueError) as exc:
        message = str(exc) if "expected" in str(exc) else f"cannot read {value!r} as {kind}"
        raise ConfigError(name, message, source) from None


def read_hf_model_config(path: str | Path) -> ModelConfig:
    """``compress_ratios`` and ``index_kpool`` of a Hugging Face config.json, at the top level or in text_config."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("model_config", f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("model_config", f"{path}: expected a JSON object")
    text_config = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}

    def lookup(key: str) -> object:
        return data[key] if key in data else text_config.get(key)

    ratios, kpool = lookup("compress_ratios") or [], lookup("index_kpool") or 0
    if not isinstance(ratios, list) or any(isinstance(r, bool) or not isinstance(r, int) for r in ratios):
        raise ConfigError("model_config", f"{path}: compress_ratios must be a list of integers, got {ratios!r}")
    if isinstance(kpool, bool) or not isinstance(kpool, int):
        raise ConfigError("model_config", f"{path}: index_kpool must be an integer, got {kpool!r}")
    try:
        return ModelConfig(tuple(ratios), kpool or None)
    except ValueError as exc:
        raise ConfigError("model_config", f"{path}: {exc}") from None


def _read_toml(text: str, source: str) -> dict[str, object]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{source}: {exc}") from None


def load_config(
    flags: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
) -> ServiceConfig:
    """The configuration from the embedded defaults, a TOML file, the environment and flags (that order)."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    sources: dict[str, str] = {}

    def put(name: str, value: object, source: str) -> None:
        if name not in SETTINGS:
            raise ConfigError(name, "unknown setting", source)
        values[name] = _coerce(name, value, source)
        sources[name] = source

    defaults = resources.files("service").joinpath("default_config.toml").read_text()
    for name, value in _read_toml(defaults, "default_config.toml").items():
        put(name, value, "default")
    missing = SETTINGS.keys() - values.keys()
    if missing:
        raise ConfigError(sorted(missing)[0], "has no default in default_config.toml")

    config_file = config_file or env.get(CONFIG_FILE_ENV)
    if config_file:
        try:
            text = Path(config_file).read_text()
        except OSError as exc:
            raise ConfigError("config", f"cannot read {config_file}: {exc}") from None
        for name, value in _read_toml(text, str(config_file)).items():
            put(name, value, f"file {config_file}")
    for name in SETTINGS:
        if (variable := ENV_PREFIX + name.upper()) in env:
            put(name, env[variable], f"env {variable}")
    for name, value in (flags or {}).items():
        put(name, value, f"flag --{name.replace('_', '-')}")

    if values["model_config"]:
        for name in ("compress_ratios", "index_kpool"):
            if sources[name] != "default":
                raise ConfigError(
                    "model_config", f"set together with {name} ({sources[name]}): use one", sources["model_config"]
                )
        model = read_hf_model_config(str(values["model_config"]))
        values["compress_ratios"], values["index_kpool"] = model.compress_ratios, model.index_kpool or 0

    config = ServiceConfig(**values)
    _validate(config, sources)
    return config


def _validate(config: ServiceConfig, sources: Mapping[str, str]) -> None:
    def check(name: str, ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(name, message, sources.get(name))

    for name in ("grpc_host", "http_host"):
        check(name, bool(getattr(config, name).strip()), "must not be empty")
    for name in ("grpc_port", "http_port", "health_port"):
        check(name, 0 <= getattr(config, name) <= 65535, f"must be in [0, 65535], got {getattr(config, name)}")
    for name in (
        "grpc_workers", "warmup_workers", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
        "max_concurrent_rpcs", "max_streams_per_connection", "max_plan_chunks", "heavy_request_bytes",
        "heavy_lane_slots", "http_max_header_bytes", "http_max_connections",
    ):  # fmt: skip
        check(name, getattr(config, name) >= 1, f"must be >= 1, got {getattr(config, name)}")
    # gRPC takes message limits as a C int.
    check(
        "max_message_bytes",
        4096 <= config.max_message_bytes <= _INT32_MAX,
        f"must be in [4096, {_INT32_MAX}], got {config.max_message_bytes}",
    )
    for name in ("malloc_arena_max", "malloc_retain_bytes"):  # mallopt takes a C int
        value = getattr(config, name)
        check(name, 0 <= value <= _INT32_MAX, f"must be in [0, {_INT32_MAX}], got {value}")
    check("response_budget_bytes", config.response_budget_bytes >= 0, "must be >= 0 (0: automatic)")
    for name in (
        "shutdown_grace_seconds", "shutdown_delay_seconds", "max_connection_age_seconds", "response_drain_seconds",
        "admission_wait_seconds", "http_idle_timeout_seconds", "idle_trim_seconds",
    ):  # fmt: skip
        check(name, getattr(config, name) >= 0, f"must be >= 0, got {getattr(config, name)}")
    check("max_logits_bytes", config.max_logits_bytes >= 4, f"must be >= 4, got {config.max_logits_bytes}")
    check("index_kpool", config.index_kpool >= 0, f"must be >= 0 (0: absent), got {config.index_kpool}")
    try:
        config.model  # noqa: B018 - ModelConfig validates every ratio, naming its index
    except ValueError as exc:
        raise ConfigError("compress_ratios", str(exc), sources.get("compress_ratios")) from None
    check("backend", config.backend in BACKENDS, f"must be one of {', '.join(BACKENDS)}, got {config.backend!r}")
    check("log_level", config.log_level.upper() in LOG_LEVELS, f"must be one of {', '.join(LOG_LEVELS)}")
    if config.warmup_enabled:
        # Imported here: the compile engine pulls in torch and Triton, which only a real warmup needs.
        from kernels.compile_engine import parse_target

        try:
            parse_target(config.warmup_target)
        except ValueError as exc:
            raise ConfigError("warmup_target", f"{exc} (or '{NO_WARMUP}')", sources.get("warmup_target")) from None
    check("strict", not (config.strict and not config.warmup_enabled), "needs a warmup, but warmup_target is none")
    check("tls_key_file", bool(config.tls_cert_file) == bool(config.tls_key_file),
          "tls_cert_file and tls_key_file go together")  # fmt: skip
    check("tls_client_ca_file", not config.tls_client_ca_file or config.tls_enabled,
          "mutual TLS needs tls_cert_file and tls_key_file too")  # fmt: skip
    for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        path = getattr(config, name)
        check(name, not path or os.access(path, os.R_OK), f"cannot read {path}")


def add_config_arguments(parser: argparse.ArgumentParser, aliases: Mapping[str, str] | None = None) -> None:
    """``--config`` and one flag per setting; only flags given on the command line override other layers."""
    parser.add_argument(
        "--config", metavar="PATH", help=f"TOML file with any of the settings (also ${CONFIG_FILE_ENV})"
    )
    group = parser.add_argument_group("settings (also INDEXER_<NAME> environment variables)")
    for name, f in SETTINGS.items():
        options = [f"--{name.replace('_', '-')}", *([aliases[name]] if aliases and name in aliases else [])]
        if f.type == "bool":
            group.add_argument(
                *options, dest=name, action=argparse.BooleanOptionalAction, default=None, help=f.metadata["help"]
            )
        else:
            group.add_argument(*options, dest=name, default=None, metavar="VALUE", help=f.metadata["help"])


def config_from_arguments(args: argparse.Namespace) -> ServiceConfig:
    flags = {name: getattr(args, name) for name in SETTINGS if getattr(args, name, None) is not None}
    return load_config(flags, config_file=args.config)


def configure_logging(level: str) -> None:
    """One line per event: time, level, logger, then ``event key=value ...``."""
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        force=True,
    )
