"""The service's one configuration object and where its values come from.

Every setting has one name used by all layers: the key in a TOML file, ``INDEXER_<NAME>`` in the environment,
``--<name-with-dashes>`` on the command line. Layers, lowest first: the embedded ``default_config.toml`` (the
only place defaults live), ``--config PATH``, the environment, the flags. Any invalid value stops the start
with a :class:`ConfigError` naming the setting and where the value came from: every setting has one rule in
:data:`RULES` (bounds, finiteness, choices), and files (model config, TLS certificates and key) are read and
parsed at load time, so nothing invalid reaches the server.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import re
import ssl
import tomllib
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path

from indexer_service.kernels.specialization import ModelConfig, parse_target
from indexer_service.service.compute.devices import BackendUnavailableError, resolve_backend

ENV_PREFIX = "INDEXER_"
CONFIG_FILE_ENV = ENV_PREFIX + "CONFIG"
BACKENDS = ("auto", "numpy", "triton")
NO_WARMUP = "none"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")
PIN_WORKERS = ("auto", "on", "off")


def _setting(help_text: str) -> object:
    """A setting's field; ``help_text`` (Markdown) is its one description: ``--help`` shows it as plain text and
    docs/service.md's settings table is generated from it (``python -m indexer_service.service.settings_table``)."""
    return field(metadata={"help": help_text})


_MARKDOWN_LINK = re.compile(r"\[([^\]]+)\]\([^)]+\)")


def plain_help(help_text: str) -> str:
    """A setting's description as ``--help`` prints it: Markdown links become their text, code loses its
    backticks, and ``%`` is escaped for argparse."""
    return _MARKDOWN_LINK.sub(r"\1", help_text).replace("`", "").replace("%", "%%")


@dataclass(frozen=True)
class ServiceConfig:
    grpc_host: str = _setting("address the gRPC server binds")
    grpc_port: int = _setting("gRPC port (0: any free port)")
    http_host: str = _setting("address both HTTP ports (`http_port`, `http_rpc_port`) bind")
    http_port: int = _setting(
        "plaintext HTTP port of GET `/metrics`, `/livez` and `/readyz` only, for Prometheus and probes (0: any "
        "free port)"
    )
    http_rpc_port: int = _setting(
        "HTTP port of the RPCs (POST `/indexer.v1.PrefillMetadata/<Method>`), with the gRPC port's TLS settings "
        "(0: any free port)"
    )
    http_rpcs: bool = _setting("serve the RPCs over HTTP on `http_rpc_port` (false: that port is not bound)")
    grpc_workers: int = _setting("threads of the gRPC server (of each worker process)")
    workers: int = _setting(
        "serving processes sharing the ports (docs/service.md, [Workers](#workers)); 0: the CPUs the container "
        "may use (its cgroup CPU quota rounded up, or its CPU affinity, whichever is smaller); 1: one process, no "
        "supervisor"
    )
    pin_workers: str = _setting(
        "each worker, with all its threads, on a CPU of its own (docs/service.md, [Workers](#workers)): `auto` "
        "where the CPU quota equals the CPU set and there is one worker per CPU (a Guaranteed pod with exclusive "
        "CPUs under the static CPU manager), `on` whenever the CPU set has a CPU per worker, `off` never"
    )
    max_message_bytes: int = _setting(
        "largest response message (64 MiB; gRPC's default is 4 MiB); requests are bounded tighter, by what a "
        "valid request at `max_num_seqs` can be (64 KiB + 32 bytes a sequence)"
    )
    max_concurrent_rpcs: int = _setting(
        "most RPCs handled at once; gRPC answers `RESOURCE_EXHAUSTED` to more at once, before spending a "
        "thread or memory"
    )
    max_concurrent_rpcs_per_peer: int = _setting(
        "most of those RPCs one peer (an IPv4 address, an IPv6 /64) may hold at once, and as many waiting for their "
        "request message; more are `RESOURCE_EXHAUSTED` at once (0: no share; behind a proxy all clients are one "
        "peer) ([overload.md](overload.md#one-gate))"
    )
    request_timeout_seconds: float = _setting(
        "seconds a call on either gRPC port may take to send its request message once opened; then it is ended "
        "`DEADLINE_EXCEEDED` ([overload.md](overload.md#one-gate))"
    )
    max_connection_age_seconds: float = _setting(
        "seconds before the server asks a client to reconnect (GOAWAY), so clients re-resolve DNS and reach "
        "replicas added since (0: never)"
    )
    max_streams_per_connection: int = _setting(
        "most concurrent calls (HTTP/2 streams) on one gRPC connection; more are refused with REFUSED_STREAM,"
        " which gRPC clients retry transparently"
    )
    health_port: int = _setting(
        "plaintext gRPC port serving only `grpc.health.v1`, on its own threads, for probes (0: any free port;"
        " in the port file as `health_port`)"
    )
    grpc_max_connections: int = _setting(
        "most open connections on the gRPC port per worker, TLS handshakes included; gRPC core closes more at "
        "accept ([overload.md](overload.md#connections))"
    )
    health_max_connections: int = _setting("most open connections on the health port; more are closed at accept")
    max_connections_per_peer: int = _setting(
        "most connections one peer (an IPv4 address, an IPv6 /64) may hold on each port of a process; those past it "
        "are closed, the latest first, about a second after accept, and counted (0: no cap; behind a proxy all "
        "clients are one peer) "
        "([overload.md](overload.md#connections))"
    )
    connection_idle_seconds: float = _setting(
        "seconds a connection to either gRPC port may carry no call before it is closed (GOAWAY) (0: never)"
    )
    handshake_timeout_seconds: float = _setting(
        "seconds a new gRPC connection has to finish its TLS handshake and send its HTTP/2 settings"
    )
    reflection_max_streams: int = _setting(
        "most server reflection streams open at once per worker, each on a thread of its own pool (never an RPC "
        "thread), two per connection; more are `RESOURCE_EXHAUSTED`"
    )
    reflection_idle_seconds: float = _setting(
        "seconds a reflection stream may wait for its next request before it is cancelled"
    )
    tls_cert_file: str = _setting(
        "PEM certificate chain of the gRPC port and `http_rpc_port`; with `tls_key_file`, TLS is on"
    )
    tls_key_file: str = _setting("PEM private key of `tls_cert_file`")
    tls_client_ca_file: str = _setting(
        "PEM CA bundle client certificates must chain to: mutual TLS (needs the two above)"
    )
    min_ready_workers: int = _setting(
        "with workers: the replica is ready while at least this many are (0: a majority); the first time, all"
    )
    worker_hang_seconds: float = _setting(
        "with workers: a worker that answers no health probe for this long is killed and restarted (0: never)"
    )
    worker_restart_backoff_seconds: float = _setting(
        "with workers: seconds before a dead worker's first restart; doubles with each death in a row (a worker that "
        "lived 30 s starts over)"
    )
    worker_restart_backoff_max_seconds: float = _setting(
        "with workers: the longest wait before a restart (the doubling's ceiling)"
    )
    shutdown_grace_seconds: float = _setting("seconds in-flight calls get to finish on SIGTERM")
    shutdown_delay_seconds: float = _setting("seconds to keep serving while `NOT_SERVING` before refusing new calls")
    compress_ratios: tuple[int, ...] = _setting(
        "per-layer compress ratios (DeepSeek-V4-Flash); comma-separated in env and flags"
    )
    index_kpool: int = _setting("kpool indexer compress ratio (0: absent)")
    model_config: str = _setting(
        "a Hugging Face `config.json`: `compress_ratios` (required) and `index_kpool`, top level or under "
        "`text_config` (conflicts with setting those two explicitly)"
    )
    max_num_batched_tokens: int = _setting("most query tokens in one request's batch")
    max_num_seqs: int = _setting("most sequences in one request's batch")
    max_model_len: int = _setting("longest sequence; also sizes the chunk KV workspace")
    max_logits_bytes: int = _setting("default logits budget of a planned chunk (512 MiB, vLLM's default)")
    max_plan_chunks: int = _setting(
        "most chunks of one PlanBatch plan; more is `RESOURCE_EXHAUSTED` before the plan is made"
    )
    response_budget_bytes: int = _setting(
        "bytes of responses held at once (built, queued or unread); one connection holds at most a quarter "
        "once it holds anything (0: min(256 MiB, memory limit / 8))"
    )
    response_drain_seconds: float = _setting(
        "seconds a caller has to read its answer before the call is cancelled (gRPC) or the connection closed (HTTP)"
    )
    heavy_request_bytes: int = _setting(
        "estimated cost (response bytes + 64 KiB per planned chunk) above which a request is heavy"
    )
    heavy_lane_slots: int = _setting("heavy requests computed at once")
    admission_wait_seconds: float = _setting(
        "longest wait for the response budget or a heavy-lane slot, never past the call's deadline"
    )
    http_max_header_bytes: int = _setting(
        "largest HTTP request head and trailers together (chunked framing lines included); more is 431 and close"
    )
    http_idle_timeout_seconds: float = _setting(
        "seconds an HTTP connection may sit with no request in progress, or take to send one"
    )
    http_max_connections: int = _setting("most open HTTP connections; more get 503 and close")
    idle_trim_seconds: float = _setting(
        "seconds with no call ending and no connection closing before free heap is handed back to the OS (also "
        "while calls go on, once 256 or more connections have closed and none closed for that long; 0: never)"
    )
    backend: str = _setting(
        "`auto` (on a CUDA GPU each request on numpy or Triton, whichever the warmup measured faster for its "
        "size; numpy without a GPU), `numpy`, `triton` (every request on the GPU); the crossover measured on the "
        "H200 host is in docs/performance.md"
    )
    warmup_target: str = _setting(
        "ahead-of-time target of the warmup without a GPU (`cuda:90`, `hip:gfx942`), or `none`"
    )
    warmup_workers: int = _setting("parallel compiles during warmup (Triton's `AsyncCompileMode`)")
    strict: bool = _setting("refuse launches that need a kernel variant outside the warmed set")
    native_fast_path: bool = _setting(
        "with the numpy backend, serve BuildChunk's common case (valid, within the limits, no DCP) in "
        "compiled C (`service/compute/fastpath.c`, built by `pip install`): the same response bytes as the Python "
        "path for far less CPU; errors, DCP and PlanBatch always take the Python path. Such calls carry "
        '`backend="native"` in `indexer_backend_duration_seconds`. Where the extension was not built (no C '
        "compiler at install), the server logs once at start `serving without the compiled fast path "
        "(service/compute/_fastpath not built)`, reports `native_fast_path=False`, and numpy serves every call"
    )
    triton_cache_dir: str = _setting(
        "Triton's cache directory; an existing `TRITON_CACHE_DIR` always wins and is never overwritten"
    )
    malloc_arena_max: int = _setting(
        "most glibc malloc arenas (0: glibc's 8 per core): idle RSS stays flat across long runs, and the idle"
        " trim can return a burst's memory (glibc's `malloc_trim` returns the main arena's free top only; "
        "with more arenas the server warns at start)"
    )
    malloc_retain_bytes: int = _setting(
        "freed memory glibc keeps per arena for reuse instead of returning it to the OS (0: glibc's default);"
        " a large response then costs no page faults on the next call, and RSS stays at its busiest peak"
    )
    log_level: str = _setting("`DEBUG`, `INFO`, `WARNING`, `ERROR`")
    log_format: str = _setting(
        "`text`: one line an event, `<UTC time>Z LEVEL logger event key=value ...`; `json`: one JSON object a "
        "line (`ts`, `level`, `logger`, `event`, `msg`, each `key=value` as a key, `request_id`, `worker`)"
    )

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
        """One log line: every setting, the long ratio list as its distinct values; then the config file read
        (``config_file``, ``none``) and where each setting not at its default came from (``sources``), as
        :func:`load_config` recorded them (:func:`sources_of`)."""
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "compress_ratios":
                value = ",".join(str(r) for r in dict.fromkeys(value)) + f" ({len(value)} layers)"
            parts.append(f"{f.name}={value}")
        sources = sources_of(self)
        config_file = next((where[5:] for where in sources.values() if where.startswith("file ")), "none")
        changed = ", ".join(f"{name}: {where}" for name, where in sources.items() if where != "default")
        parts += [f"config_file={config_file}", f"sources={json.dumps(changed or 'every setting at its default')}"]
        return " ".join(parts)


SETTINGS = {f.name: f for f in fields(ServiceConfig)}


class ConfigError(ValueError):
    """An invalid setting; ``setting`` names it, ``source`` says where its value came from."""

    def __init__(self, setting: str, message: str, source: str | None = None) -> None:
        self.setting = setting
        self.source = source
        self.message = message
        where = f" (from {source})" if source else ""
        super().__init__(f"invalid config: {setting}{where}: {message}")


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
    except (TypeError, ValueError, OverflowError) as exc:
        message = str(exc) if "expected" in str(exc) else f"cannot read {_short(value)} as {kind}"
        raise ConfigError(name, message, source) from None


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def read_hf_model_config(path: str | Path) -> ModelConfig:
    """``compress_ratios`` and ``index_kpool`` of a Hugging Face config.json, at the top level or in text_config.

    ``compress_ratios`` must be there: a config.json without it (a typo, or a model with no compressed layer)
    is an error rather than a silent "every layer uncompressed"; set ``compress_ratios`` instead.
    """
    try:
        data = json.loads(Path(path).read_text())
    except RecursionError:
        raise ConfigError("model_config", f"cannot read {path}: JSON nested too deeply") from None
    except (OSError, ValueError) as exc:
        raise ConfigError("model_config", f"cannot read {path}: {_one_line(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError("model_config", f"{path}: expected a JSON object")
    text_config = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}

    def lookup(key: str) -> object:
        return data[key] if key in data else text_config.get(key)

    ratios, kpool = lookup("compress_ratios"), lookup("index_kpool") or 0
    if ratios is None or ratios == []:
        near = sorted(k for k in {*data, *text_config} if "compress" in k.lower() or "ratio" in k.lower())
        hint = f" (found {', '.join(near)})" if near else ""
        raise ConfigError(
            "model_config",
            f"{path}: no compress_ratios, at the top level or in text_config{hint}; for a model without "
            "compressed layers set compress_ratios (and index_kpool) instead of model_config",
        )
    if not isinstance(ratios, list) or any(isinstance(r, bool) or not isinstance(r, int) for r in ratios):
        raise ConfigError("model_config", f"{path}: compress_ratios must be a list of integers, got {_short(ratios)}")
    if isinstance(kpool, bool) or not isinstance(kpool, int):
        raise ConfigError("model_config", f"{path}: index_kpool must be an integer, got {_short(kpool)}")
    for name, value in (("compress_ratios", tuple(ratios)), ("index_kpool", kpool)):
        if (why := RULES[name].problem(value)) is not None:
            raise ConfigError("model_config", f"{path}: {name}{'' if why.startswith('[') else ': '}{why}")
    return ModelConfig(tuple(ratios), kpool or None)


def _read_toml(text: str, source: str) -> dict[str, object]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{source}: {exc}") from None
    except RecursionError:
        raise ConfigError("config", f"{source}: nested too deeply") from None


def embedded_defaults() -> dict[str, object]:
    """The embedded ``default_config.toml`` as written (TOML types): every setting's default, the one place they
    live."""
    defaults = resources.files("indexer_service.service").joinpath("default_config.toml").read_text()
    return _read_toml(defaults, "default_config.toml")


def load_config(
    flags: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
    *,
    flag_names: Mapping[str, str] | None = None,
    needs_warmup: str = "",
) -> ServiceConfig:
    """The configuration from the embedded defaults, a TOML file, the environment and flags (that order).

    ``flag_names`` maps a setting to the option the user typed (an alias such as ``--target``), for messages;
    ``needs_warmup`` names a command that cannot run with ``warmup_target = "none"``.
    """
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    sources: dict[str, str] = {}

    def put(name: str, value: object, source: str) -> None:
        if name not in SETTINGS:
            raise ConfigError(name, "unknown setting", source)
        values[name] = _coerce(name, value, source)
        sources[name] = source

    for name, value in embedded_defaults().items():
        put(name, value, "default")
    missing = SETTINGS.keys() - values.keys()
    if missing:
        raise ConfigError(sorted(missing)[0], "has no default in default_config.toml")

    if config_file:
        file_source = "flag --config"
    else:
        config_file, file_source = env.get(CONFIG_FILE_ENV), f"env {CONFIG_FILE_ENV}"
    if config_file:
        try:
            text = Path(config_file).read_text()
        except (OSError, ValueError) as exc:  # ValueError: not UTF-8
            raise ConfigError("config", f"cannot read {config_file}: {_one_line(exc)}", file_source) from None
        for name, value in _read_toml(text, str(config_file)).items():
            put(name, value, f"file {config_file}")
    for name in SETTINGS:
        if (variable := ENV_PREFIX + name.upper()) in env:
            put(name, env[variable], f"env {variable}")
    for name, value in (flags or {}).items():
        option = (flag_names or {}).get(name) or f"--{name.replace('_', '-')}"
        put(name, value, f"flag {option}")

    if values["model_config"]:
        for name in ("compress_ratios", "index_kpool"):
            if sources[name] != "default":
                raise ConfigError(
                    "model_config", f"set together with {name} ({sources[name]}): use one", sources["model_config"]
                )
        try:
            model = read_hf_model_config(str(values["model_config"]))
        except ConfigError as exc:
            raise ConfigError(exc.setting, exc.message, sources["model_config"]) from None
        values["compress_ratios"], values["index_kpool"] = model.compress_ratios, model.index_kpool or 0
        sources["compress_ratios"] = sources["index_kpool"] = f"model_config {values['model_config']}"

    config = ServiceConfig(**values)
    _validate(config, sources, needs_warmup)
    _SOURCES[id(config)] = dict(sources)
    weakref.finalize(config, _SOURCES.pop, id(config), None)  # the entry goes with the configuration
    return config


# Where each setting of a loaded configuration came from, by the configuration's id while it lives.
_SOURCES: dict[int, dict[str, str]] = {}


def sources_of(config: ServiceConfig) -> dict[str, str]:
    """Where each setting of ``config`` came from (``default``, ``file PATH``, ``env NAME``, ``flag --NAME``,
    ``model_config PATH``), as :func:`load_config` found them; empty for a configuration made otherwise."""
    return _SOURCES.get(id(config), {})


def _validate(config: ServiceConfig, sources: Mapping[str, str], needs_warmup: str = "") -> None:
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
    _validate_tls(config, sources)
    _validate_cache_dir(config.triton_cache_dir, sources.get("triton_cache_dir"))


def _validate_tls(config: ServiceConfig, sources: Mapping[str, str]) -> None:
    """TLS settings go together, and their files are PEM that Python's ssl (OpenSSL) loads: a bad file is a
    config error naming the setting, not a bind failure later."""
    cert, key, client_ca = config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file
    if cert and not key:
        raise ConfigError(
            "tls_key_file", f"not set, but tls_cert_file is ({sources.get('tls_cert_file')}): TLS needs both"
        )
    if key and not cert:
        raise ConfigError(
            "tls_cert_file", f"not set, but tls_key_file is ({sources.get('tls_key_file')}): TLS needs both"
        )
    if client_ca and not cert:
        raise ConfigError(
            "tls_client_ca_file",
            "mutual TLS needs tls_cert_file and tls_key_file too",
            sources.get("tls_client_ca_file"),
        )
    if not cert:
        return
    for name, marker in (
        ("tls_cert_file", "CERTIFICATE"),
        ("tls_key_file", "PRIVATE KEY"),
        ("tls_client_ca_file", "CERTIFICATE"),
    ):
        path = getattr(config, name)
        if not path:
            continue
        try:
            text = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(name, f"cannot read {path}: {_one_line(exc)}", sources.get(name)) from None
        if f"-----BEGIN {marker}-----".encode() not in text and not (
            marker == "PRIVATE KEY" and re.search(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----", text)
        ):
            raise ConfigError(name, f"{path} is not a PEM file with a {marker.lower()}", sources.get(name))
    for name in ("tls_cert_file", "tls_client_ca_file"):
        if getattr(config, name):
            try:
                ssl.create_default_context().load_verify_locations(cafile=getattr(config, name))
            except (ssl.SSLError, OSError, ValueError) as exc:
                raise ConfigError(
                    name, f"{getattr(config, name)}: not a valid PEM certificate: {_one_line(exc)}", sources.get(name)
                ) from None
    try:
        # A key that is encrypted, broken, or not the certificate's own: the password callback keeps OpenSSL
        # from prompting on the terminal.
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=lambda: b"")
    except (ssl.SSLError, OSError, ValueError) as exc:
        message = f"{key}: not an unencrypted PEM key of {cert}: {_one_line(exc)}"
        raise ConfigError("tls_key_file", message, sources.get("tls_key_file")) from None


def _validate_cache_dir(path: str, source: str | None) -> None:
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


class _Store(argparse.Action):
    """Stores the value and remembers which option string gave it (an alias such as ``--target``)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        _remember(namespace, self.dest, option_string)


class _StoreBool(argparse.BooleanOptionalAction):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _remember(namespace, self.dest, option_string)


def _remember(namespace: argparse.Namespace, dest: str, option_string: str | None) -> None:
    names = dict(getattr(namespace, "flag_names", None) or {})
    if option_string:
        names[dest] = option_string
    namespace.flag_names = names


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
                *options, dest=name, action=_StoreBool, default=None, help=plain_help(f.metadata["help"])
            )
        else:
            group.add_argument(
                *options, dest=name, action=_Store, default=None, metavar="VALUE", help=plain_help(f.metadata["help"])
            )


def config_from_arguments(args: argparse.Namespace, needs_warmup: str = "") -> ServiceConfig:
    flags = {name: getattr(args, name) for name in SETTINGS if getattr(args, name, None) is not None}
    return load_config(
        flags, config_file=args.config, flag_names=getattr(args, "flag_names", None), needs_warmup=needs_warmup
    )


def requested_log_format(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> str:
    """The log format a command asked for, read as loading would (flag, then environment, then the config file),
    for an error found before the configuration loads; ``text`` where none says or one cannot be read."""
    env = os.environ if env is None else env
    if getattr(args, "log_format", None):
        return str(args.log_format)
    if (value := env.get(ENV_PREFIX + "LOG_FORMAT")) is not None:
        return value
    config_file = getattr(args, "config", None) or env.get(CONFIG_FILE_ENV)
    try:
        return str(tomllib.loads(Path(config_file).read_text()).get("log_format", "text")) if config_file else "text"
    except (OSError, ValueError):  # unreadable or not TOML: the error being reported says so
        return "text"


def unknown_environment(env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """``INDEXER_*`` variables that name no setting (a typo is otherwise silently ignored), each with the
    closest real variable (None when none is close; the names are compared without their common prefix)."""
    env = os.environ if env is None else env
    known = [CONFIG_FILE_ENV.removeprefix(ENV_PREFIX), *(name.upper() for name in SETTINGS)]
    unknown = sorted(name for name in env if name.startswith(ENV_PREFIX) and name.removeprefix(ENV_PREFIX) not in known)
    closest = {
        name: difflib.get_close_matches(name.removeprefix(ENV_PREFIX), known, n=1, cutoff=0.6) for name in unknown
    }
    return {name: ENV_PREFIX + found[0] if found else None for name, found in closest.items()}
