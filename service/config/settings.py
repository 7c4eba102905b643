"""The settings table: the one configuration object, :class:`ServiceConfig`, one field a setting with its help
text (``--help`` prints it, docs/service.md's table is generated from it), and :class:`ConfigError`, how a bad value
is reported."""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass, field, fields

from indexer_service.kernels.specialization import ModelConfig

ENV_PREFIX = "INDEXER_"
CONFIG_FILE_ENV = ENV_PREFIX + "CONFIG"
BACKENDS = ("auto", "numpy", "triton")
NO_WARMUP = "none"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")
PIN_WORKERS = ("auto", "on", "off")


def _setting(help_text: str) -> object:
    """A setting's field; ``help_text`` (Markdown) is its one description: ``--help`` shows it as plain text and
    docs/service.md's settings table is generated from it (``python -m indexer_service.service.config.settings_table``).
    """
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
        "are closed, the latest first, and while it holds that many the kernel drops its new ones before accept "
        "(the HTTP ports refuse them at accept, 503), all counted; on a port crowded by many peers (90 % of its own "
        "cap) each peer gets a share of 80 % of it "
        "(0: no cap; behind a proxy all clients are one peer) "
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
        (``config_file``, ``none``; named though the environment or the flags override every setting of it) and
        where each setting not at its default came from (``sources``), as :func:`load_config` recorded them
        (:func:`sources_of`)."""
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "compress_ratios":
                value = ",".join(str(r) for r in dict.fromkeys(value)) + f" ({len(value)} layers)"
            parts.append(f"{f.name}={value}")
        sources = sources_of(self)
        config_file = _LOADED.get(id(self), ({}, None))[1] or "none"  # read, even where none of it is left in force
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


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# How each loaded configuration was made, by its id while it lives: where each setting came from, and the config
# file it read (None: none).
_LOADED: dict[int, tuple[dict[str, str], str | None]] = {}


def record_loading(config: ServiceConfig, sources: dict[str, str], config_file: str | None) -> None:
    """Keep how :func:`load_config` made ``config`` for :func:`sources_of` and its config line, as long as it lives."""
    _LOADED[id(config)] = (dict(sources), config_file)
    weakref.finalize(config, _LOADED.pop, id(config), None)


def sources_of(config: ServiceConfig) -> dict[str, str]:
    """Where each setting of ``config`` came from (``default``, ``file PATH``, ``env NAME``, ``flag --NAME``,
    ``model_config PATH``), as :func:`load_config` found them; empty for a configuration made otherwise."""
    return _LOADED.get(id(config), ({}, None))[0]
