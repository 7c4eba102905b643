"""The model's compress ratios from a Hugging Face ``config.json`` (the ``model_config`` setting)."""

from __future__ import annotations

import json
from pathlib import Path

from indexer_service.kernels.specialization import ModelConfig
from indexer_service.service.config.settings import ConfigError, _one_line, _short
from indexer_service.service.config.validation import RULES


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
