"""The service's one configuration object and where its values come from.

Every setting has one name used by all layers: the key in a TOML file, ``INDEXER_<NAME>`` in the environment,
``--<name-with-dashes>`` on the command line. Layers, lowest first: the embedded ``default_config.toml`` (the
only place defaults live), ``--config PATH``, the environment, the flags. Any invalid value stops the start
with a :class:`ConfigError` naming the setting and where the value came from: every setting has one rule in
:data:`RULES` (bounds, finiteness, choices), and files (model config, TLS certificates and key) are read and
parsed at load time, so nothing invalid reaches the server.

The package's modules, one concern each: ``settings`` (the object and its help texts, :class:`ConfigError`),
``validation`` (the rules and the checks across settings), ``tls`` (the TLS files), ``model_config`` (a Hugging
Face config.json), ``loading`` (the layers), ``settings_table`` (docs/service.md's table); the command-line flags
are the CLI's (service/process/flags.py). Callers import from here.
"""

from __future__ import annotations

from indexer_service.service.config.loading import embedded_defaults, load_config, unknown_environment
from indexer_service.service.config.model_config import read_hf_model_config
from indexer_service.service.config.settings import (
    BACKENDS,
    CONFIG_FILE_ENV,
    ENV_PREFIX,
    LOG_FORMATS,
    LOG_LEVELS,
    NO_WARMUP,
    PIN_WORKERS,
    SETTINGS,
    ConfigError,
    ServiceConfig,
    plain_help,
    sources_of,
)
from indexer_service.service.config.validation import MAX_COMPRESS_RATIO, MAX_SECONDS, MAX_WORKERS, RULES, Rule

__all__ = [
    "BACKENDS",
    "CONFIG_FILE_ENV",
    "ENV_PREFIX",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "MAX_COMPRESS_RATIO",
    "MAX_SECONDS",
    "MAX_WORKERS",
    "NO_WARMUP",
    "PIN_WORKERS",
    "RULES",
    "SETTINGS",
    "ConfigError",
    "Rule",
    "ServiceConfig",
    "embedded_defaults",
    "load_config",
    "plain_help",
    "read_hf_model_config",
    "sources_of",
    "unknown_environment",
]
