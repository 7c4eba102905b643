"""Layered loading: the embedded ``default_config.toml``, ``--config PATH``, the environment, the flags (that
order), each value read as its setting's type and the result validated."""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

from indexer_service.service.config.model_config import read_hf_model_config
from indexer_service.service.config.settings import (
    CONFIG_FILE_ENV,
    ENV_PREFIX,
    SETTINGS,
    ConfigError,
    ServiceConfig,
    _one_line,
    _short,
    record_loading,
)
from indexer_service.service.config.validation import validate
from indexer_service.service.observability.version import COMMIT_ENV, IMAGE_REVISION_ENV

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
    defaults = resources.files("indexer_service.service.config").joinpath("default_config.toml").read_text()
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
    validate(config, sources, needs_warmup)
    record_loading(config, sources, str(config_file) if config_file else None)
    return config


def unknown_environment(env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """``INDEXER_*`` variables that name no setting (a typo is otherwise silently ignored), each with the
    closest real variable (None when none is close; the names are compared without their common prefix)."""
    env = os.environ if env is None else env
    # The build's own variables (the image sets them) name the build, not a setting.
    not_settings = (CONFIG_FILE_ENV, COMMIT_ENV, IMAGE_REVISION_ENV)
    known = [*(name.removeprefix(ENV_PREFIX) for name in not_settings), *(name.upper() for name in SETTINGS)]
    unknown = sorted(name for name in env if name.startswith(ENV_PREFIX) and name.removeprefix(ENV_PREFIX) not in known)
    closest = {
        name: difflib.get_close_matches(name.removeprefix(ENV_PREFIX), known, n=1, cutoff=0.6) for name in unknown
    }
    return {name: ENV_PREFIX + found[0] if found else None for name, found in closest.items()}
