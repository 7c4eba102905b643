"""Configuration: embedded defaults, file, environment, flags (that precedence), Hugging Face model configs,
and a clear error naming the setting for every invalid value."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kernels.specialization import ModelConfig, warmup_compress_ratios
from service.config import SETTINGS, ConfigError, load_config, read_hf_model_config
from service.warmup import use_triton_cache_dir

FLASH_RATIOS = (0, 0, *([4, 128] * 20), 4, 0)


def test_embedded_defaults_are_the_issue_defaults() -> None:
    config = load_config(env={})
    assert config.compress_ratios == FLASH_RATIOS
    assert warmup_compress_ratios(config.model) == (1, 4, 128)
    assert (config.grpc_host, config.grpc_port, config.http_host, config.http_port) == (
        "0.0.0.0",
        50051,
        "0.0.0.0",
        8080,
    )
    assert config.max_num_batched_tokens == 8192
    assert config.max_model_len >= 1 << 20
    assert config.max_message_bytes > 4 * 2**20
    assert config.warmup_target == "cuda:90"
    assert config.shutdown_grace_seconds == 10.0
    assert not config.strict


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path: Path) -> None:
    config_file = tmp_path / "indexer.toml"
    config_file.write_text('grpc_port = 1111\nhttp_port = 2222\nmax_num_seqs = 7\nlog_level = "DEBUG"\n')
    env = {"INDEXER_HTTP_PORT": "3333", "INDEXER_MAX_NUM_SEQS": "8", "INDEXER_STRICT": "true"}
    config = load_config({"max_num_seqs": "9"}, env=env, config_file=config_file)
    assert config.grpc_port == 1111  # file
    assert config.http_port == 3333  # env over file
    assert config.max_num_seqs == 9  # flag over env over file
    assert config.strict is True  # env
    assert config.log_level == "DEBUG"
    assert config.max_num_batched_tokens == 8192  # default


def test_config_file_from_the_environment(tmp_path: Path) -> None:
    config_file = tmp_path / "indexer.toml"
    config_file.write_text("compress_ratios = [4]\nindex_kpool = 32\n")
    config = load_config(env={"INDEXER_CONFIG": str(config_file)})
    assert warmup_compress_ratios(config.model) == (4, 32)


def test_list_settings_from_env_and_flags_are_comma_separated() -> None:
    config = load_config({"compress_ratios": "0,4"}, env={"INDEXER_COMPRESS_RATIOS": "128"})
    assert config.compress_ratios == (0, 4)


@pytest.mark.parametrize(
    ("flags", "env", "setting", "fragment"),
    [
        ({"grpc_port": "70000"}, {}, "grpc_port", "[0, 65535]"),
        ({}, {"INDEXER_HTTP_PORT": "eighty"}, "http_port", "env INDEXER_HTTP_PORT"),
        ({"max_num_seqs": "0"}, {}, "max_num_seqs", ">= 1"),
        ({"compress_ratios": "4,-2"}, {}, "compress_ratios", "compress_ratios[1]"),
        ({"backend": "cuda"}, {}, "backend", "auto, numpy, triton"),
        ({"warmup_target": "sm90"}, {}, "warmup_target", "cuda:90"),
        ({"strict": True, "warmup_target": "none"}, {}, "strict", "warmup"),
        ({}, {"INDEXER_STRICT": "maybe"}, "strict", "true or false"),
        ({"max_message_bytes": "100"}, {}, "max_message_bytes", "4096"),
        ({"shutdown_grace_seconds": "-1"}, {}, "shutdown_grace_seconds", ">= 0"),
        ({"log_level": "loud"}, {}, "log_level", "INFO"),
        ({"grpc_host": " "}, {}, "grpc_host", "empty"),
    ],
)
def test_invalid_values_name_the_setting(flags: dict, env: dict, setting: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(flags, env=env)
    assert raised.value.setting == setting
    assert setting in str(raised.value) and fragment in str(raised.value)


def test_unknown_and_mistyped_file_settings_are_errors(tmp_path: Path) -> None:
    config_file = tmp_path / "indexer.toml"
    config_file.write_text("grpc_prot = 1\n")
    with pytest.raises(ConfigError, match=r"grpc_prot \(from file .*\): unknown setting"):
        load_config(env={}, config_file=config_file)
    config_file.write_text('max_num_seqs = "many"\n')
    with pytest.raises(ConfigError, match="max_num_seqs"):
        load_config(env={}, config_file=config_file)
    config_file.write_text("max_num_seqs = [\n")
    with pytest.raises(ConfigError, match="config"):
        load_config(env={}, config_file=config_file)


def test_every_setting_has_an_embedded_default_and_help() -> None:
    config = load_config(env={})
    for name, field in SETTINGS.items():
        assert getattr(config, name) is not None
        assert field.metadata["help"]


def _write_json(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_hf_model_config_top_level_and_text_config(tmp_path: Path) -> None:
    top = _write_json(tmp_path / "top.json", {"compress_ratios": list(FLASH_RATIOS), "index_kpool": None})
    assert read_hf_model_config(top) == ModelConfig(FLASH_RATIOS, None)
    nested = _write_json(tmp_path / "nested.json", {"text_config": {"compress_ratios": [0, 4], "index_kpool": 32}})
    assert warmup_compress_ratios(read_hf_model_config(nested)) == (1, 4, 32)
    glm = _write_json(tmp_path / "glm.json", {"model_type": "glm", "text_config": {"index_kpool": 4}})
    assert warmup_compress_ratios(read_hf_model_config(glm)) == (1, 4)
    plain = _write_json(tmp_path / "plain.json", {"model_type": "deepseek_v32"})
    assert warmup_compress_ratios(read_hf_model_config(plain)) == (1,)
    config = load_config({"model_config": str(nested)}, env={})
    assert warmup_compress_ratios(config.model) == (1, 4, 32)


def test_hf_model_config_errors_name_the_setting(tmp_path: Path) -> None:
    cases = {
        "missing.json": None,
        "broken.json": "{",
        "negative.json": json.dumps({"compress_ratios": [4, -1]}),
        "strings.json": json.dumps({"compress_ratios": ["4"]}),
    }
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(ConfigError, match=f"model_config.*{name}"):
            load_config({"model_config": str(path)}, env={})


def test_model_config_and_explicit_ratios_conflict(tmp_path: Path) -> None:
    path = _write_json(tmp_path / "config.json", {"compress_ratios": [4]})
    with pytest.raises(ConfigError, match=r"model_config.*compress_ratios.*use one"):
        load_config({"model_config": str(path)}, env={"INDEXER_COMPRESS_RATIOS": "4"})


def test_existing_triton_cache_dir_is_never_overwritten(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "from-env"))
    assert use_triton_cache_dir(str(tmp_path / "configured")) == str(tmp_path / "from-env")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "from-env")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert use_triton_cache_dir(str(tmp_path / "configured")) == str(tmp_path / "configured")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "configured")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert use_triton_cache_dir("") is None
    assert "TRITON_CACHE_DIR" not in os.environ


def test_docs_list_every_setting_and_metric() -> None:
    from service.metrics import Metrics

    docs = (Path(__file__).resolve().parent.parent / "docs" / "service.md").read_text()
    for name in SETTINGS:
        assert f"| `{name}` |" in docs, f"docs/service.md does not describe the setting {name}"
    for family in Metrics().registry.collect():
        name = f"{family.name}_total" if family.type == "counter" else family.name
        assert f"| `{name}` |" in docs, f"docs/service.md does not list the metric {name}"
