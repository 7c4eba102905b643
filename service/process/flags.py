"""The settings as command-line flags: ``--config`` and one ``--<name>`` a setting, each remembering the option the
user typed (an alias such as ``--target``) for messages."""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path

from indexer_service.service.config import (
    CONFIG_FILE_ENV,
    ENV_PREFIX,
    SETTINGS,
    ServiceConfig,
    load_config,
    plain_help,
)


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
