"""Validation: the range of every setting (:data:`RULES`, one :class:`Rule` a setting) and the checks of settings
that depend on each other or on the machine, run on every configuration :func:`load_config` makes."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from indexer_service.kernels.specialization import parse_target
from indexer_service.service.compute.devices import BackendUnavailableError, resolve_backend
from indexer_service.service.config.settings import (
    BACKENDS,
    LOG_FORMATS,
    LOG_LEVELS,
    NO_WARMUP,
    PIN_WORKERS,
    SETTINGS,
    ConfigError,
    ServiceConfig,
    _one_line,
)
from indexer_service.service.config.tls import validate_tls

# --- the range of every setting --------------------------------------------------------------------------

_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
# Durations: gRPC and the HTTP server take some of them as int32 milliseconds (max_connection_age_ms), so
# every duration is held to that range: about 24.8 days.
MAX_SECONDS = _INT32_MAX / 1000
# A compress ratio is a Triton constexpr and a request's int32 field; 2^20 (the default max_model_len) is far
# above any real model's (4, 128) and compiles in every backend.
MAX_COMPRESS_RATIO = 2**20
# Serving processes of one replica: each holds a gRPC server, an interpreter and its arrays.
MAX_WORKERS = 256


@dataclass(frozen=True)
class Rule:
    """What one setting accepts, beyond its type: bounds (inclusive unless ``above``), choices, non-empty.

    Floats must also be finite (no inf, no nan). ``zero`` names what 0 means where 0 is allowed below ``low``.
    """

    low: float | None = None
    high: float | None = None
    above: float | None = None  # exclusive lower bound
    zero: str = ""  # "0 means ...": 0 is accepted even when below ``low``
    choices: tuple[str, ...] = ()
    fold_case: bool = False  # choices match in any case
    nonempty: bool = False

    def problem(self, value: object) -> str | None:
        """Why ``value`` is out of range, or None."""
        if isinstance(value, tuple):
            for i, item in enumerate(value):
                if (why := self.problem(item)) is not None:
                    return f"[{i}]: {why}"
            return None
        if isinstance(value, str):
            if self.nonempty and not value.strip():
                return "must not be empty"
            fold = str.upper if self.fold_case else str
            if self.choices and fold(value) not in {fold(c) for c in self.choices}:
                return f"must be one of {', '.join(self.choices)}, got {value!r}"
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        if value == 0 and self.zero:
            return None
        zero = f" (or 0: {self.zero})" if self.zero else ""
        low_ok = value > self.above if self.above is not None else self.low is None or value >= self.low
        if low_ok and (self.high is None or value <= self.high):
            return None
        opening = f"({_number(self.above)}" if self.above is not None else f"[{_number(self.low)}"
        if self.high is None:
            return f"must be {'>' if self.above is not None else '>='} {opening[1:]}{zero}, got {value}"
        if self.low is None and self.above is None:
            return f"must be <= {_number(self.high)}{zero}, got {value}"
        return f"must be in {opening}, {_number(self.high)}]{zero}, got {value}"


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else repr(bound)


_PORT = Rule(0, 65535)
_COUNT32 = Rule(1, _INT32_MAX)  # counts and sizes gRPC, C or int32 kernels take
_SECONDS = Rule(0, MAX_SECONDS)
_RATIO = Rule(0, MAX_COMPRESS_RATIO)
_PATH = Rule()  # files are checked by loading them, below

# One rule per setting (tests/service/test_config.py holds every setting to it, from every layer).
RULES: dict[str, Rule] = {
    "grpc_host": Rule(nonempty=True),
    "grpc_port": _PORT,
    "http_host": Rule(nonempty=True),
    "http_port": _PORT,
    "http_rpc_port": _PORT,
    "http_rpcs": Rule(),
    "grpc_workers": _COUNT32,
    "workers": Rule(1, MAX_WORKERS, zero="the CPUs the container may use"),
    "pin_workers": Rule(choices=PIN_WORKERS, fold_case=True),
    "min_ready_workers": Rule(1, MAX_WORKERS, zero="a majority of the workers"),  # above workers: all of them
    "worker_hang_seconds": Rule(0.5, MAX_SECONDS, zero="never"),  # probes go every quarter of it
    "worker_restart_backoff_seconds": Rule(0.01, MAX_SECONDS),  # 0 would restart a crash loop flat out
    "worker_restart_backoff_max_seconds": Rule(0.01, MAX_SECONDS),
    "max_message_bytes": Rule(4096, _INT32_MAX),  # gRPC takes message limits as a C int
    "max_concurrent_rpcs": _COUNT32,
    "max_concurrent_rpcs_per_peer": Rule(1, _INT32_MAX, zero="no share"),
    "request_timeout_seconds": Rule(above=0, high=MAX_SECONDS),
    "max_connection_age_seconds": Rule(0.001, MAX_SECONDS, zero="never"),  # int32 milliseconds in gRPC
    "max_streams_per_connection": _COUNT32,  # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS, a C int in gRPC
    "health_port": _PORT,
    "grpc_max_connections": _COUNT32,  # grpc.max_allowed_incoming_connections, a C int
    "health_max_connections": _COUNT32,
    "max_connections_per_peer": Rule(1, _INT32_MAX, zero="no cap"),
    "connection_idle_seconds": Rule(0.001, MAX_SECONDS, zero="never"),  # int32 milliseconds in gRPC
    "handshake_timeout_seconds": Rule(0.001, MAX_SECONDS),  # int32 milliseconds in gRPC
    "reflection_max_streams": _COUNT32,
    "reflection_idle_seconds": Rule(above=0, high=MAX_SECONDS),
    "tls_cert_file": _PATH,
    "tls_key_file": _PATH,
    "tls_client_ca_file": _PATH,
    "shutdown_grace_seconds": _SECONDS,
    "shutdown_delay_seconds": _SECONDS,
    "compress_ratios": _RATIO,  # each
    "index_kpool": _RATIO,
    "model_config": _PATH,
    "max_num_batched_tokens": _COUNT32,  # int32 in the kernel and on the wire
    "max_num_seqs": _COUNT32,
    "max_model_len": _COUNT32,
    "max_logits_bytes": Rule(4, _INT64_MAX),  # int64 on the wire (PlanBatchRequest.max_logits_bytes)
    "max_plan_chunks": _COUNT32,
    "response_budget_bytes": Rule(1, _INT64_MAX, zero="automatic"),
    "response_drain_seconds": Rule(above=0, high=MAX_SECONDS),
    "heavy_request_bytes": Rule(1, _INT64_MAX),
    "heavy_lane_slots": _COUNT32,
    "admission_wait_seconds": _SECONDS,
    "http_max_header_bytes": Rule(1024, _INT32_MAX),  # below 1 KiB even a probe's request head is refused
    "http_idle_timeout_seconds": Rule(above=0, high=MAX_SECONDS),
    "http_max_connections": _COUNT32,
    "idle_trim_seconds": Rule(0, MAX_SECONDS),  # 0: never
    "backend": Rule(choices=BACKENDS),
    "warmup_target": Rule(nonempty=True),  # parsed by the compile engine, below
    "warmup_workers": _COUNT32,
    "strict": Rule(),
    "native_fast_path": Rule(),
    "triton_cache_dir": _PATH,
    "malloc_arena_max": Rule(0, _INT32_MAX),  # mallopt takes a C int; 0: glibc's default
    "malloc_retain_bytes": Rule(0, _INT32_MAX),
    "log_level": Rule(choices=LOG_LEVELS, fold_case=True),
    "log_format": Rule(choices=LOG_FORMATS),
}


def validate(config: ServiceConfig, sources: Mapping[str, str], needs_warmup: str = "") -> None:
    def fail(name: str, message: str, source: str | None = None) -> None:
        raise ConfigError(name, message, source or sources.get(name))

    # Every setting against its rule, in the order of the settings.
    for name in SETTINGS:
        why = RULES.get(name, Rule()).problem(getattr(config, name))
        if why is not None:
            fail(name, f"{name}{why}" if why.startswith("[") else why)
    # Settings that depend on each other, or on the machine.
    if config.backend == "triton":
        try:
            resolve_backend("triton")  # imports torch: only for an explicit triton
        except BackendUnavailableError as exc:
            fail("backend", str(exc))
    if config.warmup_enabled:
        try:
            parse_target(config.warmup_target)
        except ValueError as exc:
            fail("warmup_target", f"{_one_line(exc)} (or '{NO_WARMUP}')")
    elif needs_warmup:
        fail("warmup_target", f"{needs_warmup} needs a target such as cuda:90, got {NO_WARMUP!r}")
    first, ceiling = config.worker_restart_backoff_seconds, config.worker_restart_backoff_max_seconds
    if ceiling < first:  # blame the one the user set (both set: the ceiling)
        if sources.get("worker_restart_backoff_max_seconds") == "default":
            fail(
                "worker_restart_backoff_seconds",
                f"must be at most worker_restart_backoff_max_seconds ({ceiling:g}), got {first:g}",
            )
        fail(
            "worker_restart_backoff_max_seconds",
            f"must be at least worker_restart_backoff_seconds ({first:g}), got {ceiling:g}",
        )
    if config.strict and not config.warmup_enabled:
        fail("strict", f"needs a warmup, but warmup_target is none ({sources.get('warmup_target')})")
    validate_tls(config, sources)
    validate_cache_dir(config.triton_cache_dir, sources.get("triton_cache_dir"))


def validate_cache_dir(path: str, source: str | None) -> None:
    """A configured Triton cache directory is a directory, or can be made one (its nearest existing ancestor
    is a writable directory)."""
    if not path:
        return
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError("triton_cache_dir", f"{existing} is not a directory", source)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError("triton_cache_dir", f"{existing} is not writable", source)
