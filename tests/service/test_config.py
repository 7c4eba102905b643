"""Configuration: embedded defaults, file, environment, flags (that precedence), Hugging Face model configs,
and a clear error naming the setting for every invalid value."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from indexer_service.kernels.specialization import ModelConfig, warmup_compress_ratios
from indexer_service.service.compute.warmup import use_triton_cache_dir
from indexer_service.service.config import RULES, SETTINGS, ConfigError, load_config, read_hf_model_config
from testkit.paths import REPO

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


def test_the_config_line_names_the_config_file_and_each_value_s_source(tmp_path: Path) -> None:
    # Issue 37: the config line names the config file read and where each setting not at its default came from,
    # the file named even where the environment or the flags override every setting it has, or it has none.
    config_file = tmp_path / "indexer.toml"
    config_file.write_text("grpc_port = 1111\nmax_num_seqs = 7\n")
    summary = load_config({"grpc_port": "4444"}, env={"INDEXER_HTTP_PORT": "3333"}, config_file=config_file).summary()
    assert f" config_file={config_file} " in summary
    sources = json.loads(summary.partition(" sources=")[2])
    assert sources == (
        f"grpc_port: flag --grpc-port, http_port: env INDEXER_HTTP_PORT, max_num_seqs: file {config_file}"
    )
    overridden = load_config(env={"INDEXER_MAX_NUM_SEQS": "8", "INDEXER_GRPC_PORT": "1"}, config_file=config_file)
    assert f" config_file={config_file} " in overridden.summary()
    config_file.write_text("")
    assert f" config_file={config_file} " in load_config(env={}, config_file=config_file).summary()
    none = load_config(env={}).summary()
    assert ' config_file=none sources="every setting at its default"' in none


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
        ({"max_num_seqs": "0"}, {}, "max_num_seqs", "[1, 2147483647]"),
        ({"compress_ratios": "4,-2"}, {}, "compress_ratios", "compress_ratios[1]"),
        ({"backend": "cuda"}, {}, "backend", "auto, numpy, triton"),
        ({"warmup_target": "sm90"}, {}, "warmup_target", "cuda:90"),
        ({"strict": True, "warmup_target": "none"}, {}, "strict", "warmup"),
        ({}, {"INDEXER_STRICT": "maybe"}, "strict", "true or false"),
        ({"max_message_bytes": "100"}, {}, "max_message_bytes", "4096"),
        ({"shutdown_grace_seconds": "-1"}, {}, "shutdown_grace_seconds", "[0, 2147483.647]"),
        ({"max_connection_age_seconds": "inf"}, {}, "max_connection_age_seconds", "finite"),
        ({"max_connection_age_seconds": "1e12"}, {}, "max_connection_age_seconds", "(or 0: never)"),
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
    glm = _write_json(tmp_path / "glm.json", {"text_config": {"compress_ratios": [0, 0], "index_kpool": 4}})
    assert warmup_compress_ratios(read_hf_model_config(glm)) == (1, 4)
    config = load_config({"model_config": str(nested)}, env={})
    assert warmup_compress_ratios(config.model) == (1, 4, 32)


def test_hf_model_config_errors_name_the_setting(tmp_path: Path) -> None:
    cases = {
        "missing.json": None,
        "broken.json": "{",
        "negative.json": json.dumps({"compress_ratios": [4, -1]}),
        "strings.json": json.dumps({"compress_ratios": ["4"]}),
        "huge.json": json.dumps({"compress_ratios": [4, 2**40]}),
        "deep.json": "[" * 100_000 + "]" * 100_000,
        # A model without compressed layers, or a typo: an error, not a silent "ratio 1 only".
        "typo.json": json.dumps({"compress_ratio": [4, 128]}),
        "plain.json": json.dumps({"model_type": "deepseek_v32", "text_config": {"index_kpool": 4}}),
        "empty.json": json.dumps({"compress_ratios": []}),
        "binary.json": None,
    }
    for name, text in cases.items():
        path = tmp_path / name
        if name == "binary.json":
            path.write_bytes(b"\xff\xfe\x00{")
        elif text is not None:
            path.write_text(text)
        with pytest.raises(ConfigError, match=f"model_config.*{name}") as raised:
            load_config({"model_config": str(path)}, env={})
        assert "\n" not in str(raised.value) and len(str(raised.value)) < 400
    with pytest.raises(ConfigError, match=r"typo.json: no compress_ratios.*\(found compress_ratio\)"):
        read_hf_model_config(tmp_path / "typo.json")


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
    from indexer_service.service.observability.metrics import Metrics

    docs = (REPO / "docs" / "service.md").read_text()
    for name in SETTINGS:
        assert f"| `{name}` |" in docs, f"docs/service.md does not describe the setting {name}"
    for family in Metrics().registry.collect():
        name = f"{family.name}_total" if family.type == "counter" else family.name
        assert f"| `{name}` |" in docs, f"docs/service.md does not list the metric {name}"


# --- every setting, every layer: the range table ------------------------------------------------------------

TOO_BIG_INT32 = str(2**31)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """PEM files (a CA, a server certificate and its key, another key), a non-PEM file, model configs."""
    import trustme

    folder = tmp_path_factory.mktemp("files")
    ca = trustme.CA()
    server, other = ca.issue_cert("127.0.0.1"), ca.issue_cert("other.example")
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    server.cert_chain_pems[0].write_to_path(str(folder / "cert.pem"))
    server.private_key_pem.write_to_path(str(folder / "key.pem"))
    other.private_key_pem.write_to_path(str(folder / "other-key.pem"))
    (folder / "junk.pem").write_text("not a certificate\n")
    (folder / "der.pem").write_bytes(b"0\x82\x01\x0a" + bytes(200))
    (folder / "broken-cert.pem").write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    (folder / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (folder / "no-ratios.json").write_text(json.dumps({"model_type": "x", "compress_ratio": [4]}))
    (folder / "file").write_text("")
    return {p.stem.replace("-", "_"): str(p) for p in folder.iterdir()}


# setting -> invalid values (text, as a flag or an environment variable gives them; {name} is a file above),
# and the other settings that value needs to be the one at fault. Every setting has at least one.
VALID_TLS = {"tls_cert_file": "{cert}", "tls_key_file": "{key}"}
INVALID: dict[str, tuple[list[str], dict[str, str]]] = {
    "grpc_host": ([" "], {}),
    "grpc_port": (["70000", "-1", "eighty", "1.5"], {}),
    "http_host": ([""], {}),
    "http_port": (["65536"], {}),
    "http_rpc_port": (["65536", "-1"], {}),
    "http_rpcs": (["maybe"], {}),
    "grpc_workers": (["0", TOO_BIG_INT32], {}),
    "workers": (["-1", "257", "two", "1.5"], {}),
    "max_message_bytes": (["100", TOO_BIG_INT32], {}),
    "max_concurrent_rpcs": (["0", TOO_BIG_INT32], {}),
    "max_concurrent_rpcs_per_peer": (["-1", TOO_BIG_INT32], {}),
    "request_timeout_seconds": (["0", "inf", "-1"], {}),
    "max_connection_age_seconds": (["inf", "nan", "1e12", "2147484", "-1", "0.0001", "soon"], {}),
    "max_streams_per_connection": (["0", TOO_BIG_INT32], {}),
    "grpc_max_connections": (["0", TOO_BIG_INT32, "-1"], {}),
    "health_max_connections": (["0", TOO_BIG_INT32], {}),
    "connection_idle_seconds": (["inf", "2147484", "-1", "0.0001"], {}),
    "handshake_timeout_seconds": (["0", "inf", "2147484", "-1"], {}),
    "reflection_max_streams": (["0", TOO_BIG_INT32], {}),
    "reflection_idle_seconds": (["0", "inf", "-1"], {}),
    "health_port": (["70000", "-1"], {}),
    "tls_cert_file": (["/nonexistent.pem", "{junk}", "{der}", "{broken_cert}"], {"tls_key_file": "{key}"}),
    "tls_key_file": (["/nonexistent.pem", "{junk}", "{other_key}", "{cert}"], {"tls_cert_file": "{cert}"}),
    "tls_client_ca_file": (["/nonexistent.pem", "{junk}", "{broken_cert}"], VALID_TLS),
    "shutdown_grace_seconds": (["-1", "inf", "1e10"], {}),
    "shutdown_delay_seconds": (["nan", "-0.5"], {}),
    "compress_ratios": (["4,-2", "1099511627776", "4,x", str(2**20 + 1)], {}),
    "index_kpool": (["-1", str(2**20 + 1)], {}),
    "model_config": (["/nonexistent.json", "{deep}", "{no_ratios}", "{junk}"], {}),
    "max_num_batched_tokens": (["0", TOO_BIG_INT32], {}),
    "max_num_seqs": (["0", "-5"], {}),
    "max_model_len": (["0", TOO_BIG_INT32], {}),
    "max_logits_bytes": (["3", str(2**63)], {}),
    "max_plan_chunks": (["0", TOO_BIG_INT32], {}),
    "response_budget_bytes": (["-1", str(2**63)], {}),
    "response_drain_seconds": (["0", "inf", "-1"], {}),
    "heavy_request_bytes": (["0"], {}),
    "heavy_lane_slots": (["0", TOO_BIG_INT32], {}),
    "admission_wait_seconds": (["-0.5", "nan"], {}),
    "http_max_header_bytes": (["100", TOO_BIG_INT32], {}),
    "http_idle_timeout_seconds": (["0", "inf"], {}),
    "http_max_connections": (["0"], {}),
    "idle_trim_seconds": (["-1", "inf"], {}),
    "backend": (["cuda", "NUMPY"], {}),
    "warmup_target": (["sm90", ""], {}),
    "warmup_workers": (["0", TOO_BIG_INT32], {}),
    "strict": (["maybe"], {}),
    "native_fast_path": (["2"], {}),
    "triton_cache_dir": (["{file}/cache"], {}),
    "malloc_arena_max": (["-1", TOO_BIG_INT32], {}),
    "malloc_retain_bytes": ([TOO_BIG_INT32], {}),
    "log_level": (["loud"], {}),
    "log_format": (["yaml", "JSON"], {}),
    "pin_workers": (["always", "ON "], {}),
    "min_ready_workers": (["-1", "257"], {}),
    "worker_hang_seconds": (["0.1", "-1", "inf"], {}),
    "max_connections_per_peer": (["-1", "2147483648", "many"], {}),
    "worker_restart_backoff_seconds": (["0", "-1", "nan", "20"], {}),  # 20: above the maximum (10)
    "worker_restart_backoff_max_seconds": (["0.001", "inf", "0.2"], {}),  # 0.2: below the first backoff (0.5)
}
LAYERS = ("flag", "env", "file")


def test_the_tables_cover_every_setting() -> None:
    assert set(RULES) == set(SETTINGS)
    assert set(INVALID) == set(SETTINGS), "give every new setting invalid values in INVALID"


def _toml_value(name: str, text: str) -> str:
    """The TOML a user would write for ``text``: numbers bare (TOML has inf and nan), lists as arrays."""
    kind = SETTINGS[name].type
    if kind == "tuple[int, ...]":
        items = text.split(",")
        return "[" + ", ".join(i if i.lstrip("-").isdigit() else json.dumps(i) for i in items) + "]"
    if kind in ("int", "float"):
        try:
            float(text)
            return text
        except ValueError:
            pass
    return json.dumps(text)


def _cases() -> list:
    cases = []
    for name, (values, _) in INVALID.items():
        for i, value in enumerate(values):
            # The first value through every layer, the others through one layer each, in turn.
            for layer in LAYERS if i == 0 else (LAYERS[i % 3],):
                cases.append(pytest.param(name, value, layer, id=f"{name}-{layer}-{i}"))
    return cases


@pytest.mark.parametrize(("name", "value", "layer"), _cases())
def test_every_invalid_value_stops_the_start_naming_setting_and_source(
    name: str, value: str, layer: str, files: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Through the command line in-process: exit 2, one stderr line, the setting and where its value came from,
    never a traceback."""
    from indexer_service.service.process.cli import main as cli_main

    value = value.format(**files)
    extra = {k: v.format(**files) for k, v in INVALID[name][1].items()}
    args = ["serve"]
    if name not in ("warmup_target", "strict"):
        args += ["--warmup-target", "none"]  # no torch import for the compile engine's target parser
    for other, other_value in extra.items():
        args += [f"--{other.replace('_', '-')}", other_value]
    env = {}
    if layer == "flag" and SETTINGS[name].type == "bool":
        # A boolean flag has no value to get wrong (--strict / --no-strict): argparse refuses one, exit 2.
        with pytest.raises(SystemExit) as usage:
            cli_main([*args, f"--{name.replace('_', '-')}={value}"])
        err = capsys.readouterr().err
        assert usage.value.code == 2 and f"--{name.replace('_', '-')}" in err and "Traceback" not in err
        return
    if layer == "flag":
        args += [f"--{name.replace('_', '-')}={value}"]
        source = f"flag --{name.replace('_', '-')}"
    elif layer == "env":
        env[f"INDEXER_{name.upper()}"] = value
        source = f"env INDEXER_{name.upper()}"
    else:
        config_file = tmp_path / "indexer.toml"
        config_file.write_text(f"{name} = {_toml_value(name, value)}\n")
        args += ["--config", str(config_file)]
        source = f"file {config_file}"
    with pytest.MonkeyPatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("INDEXER_")]:
            patch.delenv(key)
        for key, text in env.items():
            patch.setenv(key, text)
        code = cli_main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"indexer-service serve: invalid config: {name} (from {source}): "), err


@pytest.mark.parametrize(
    ("flags", "setting", "fragment"),
    [
        ({"tls_cert_file": "{cert}"}, "tls_key_file", "tls_cert_file is (flag --tls-cert-file)"),
        ({"tls_key_file": "{key}"}, "tls_cert_file", "tls_key_file is (flag --tls-key-file)"),
        ({"tls_client_ca_file": "{ca}"}, "tls_client_ca_file", "from flag --tls-client-ca-file"),
        ({"strict": True, "warmup_target": "none"}, "strict", "warmup_target is none (flag --warmup-target)"),
        (
            {"worker_restart_backoff_seconds": "2", "worker_restart_backoff_max_seconds": "1"},
            "worker_restart_backoff_max_seconds",
            "must be at least worker_restart_backoff_seconds (2), got 1",
        ),
    ],
)
def test_settings_that_go_together_blame_the_missing_one(
    flags: dict, setting: str, fragment: str, files: dict[str, str]
) -> None:
    flags = {k: v.format(**files) if isinstance(v, str) else v for k, v in flags.items()}
    with pytest.raises(ConfigError) as raised:
        load_config(flags, env={})
    assert raised.value.setting == setting and fragment in str(raised.value), str(raised.value)
    assert "(from default)" not in str(raised.value)


def test_valid_tls_and_edge_values_are_accepted(files: dict[str, str]) -> None:
    config = load_config(
        {
            "tls_cert_file": files["cert"],
            "tls_key_file": files["key"],
            "tls_client_ca_file": files["ca"],
            "max_connection_age_seconds": "0",
            "response_budget_bytes": "0",
            "idle_trim_seconds": "0",
            "compress_ratios": f"0,{2**20}",
            "grpc_port": "65535",
            "health_port": "0",
            "log_level": "debug",
            "max_message_bytes": str(2**31 - 1),
        },
        env={"INDEXER_MAX_CONNECTION_AGE_SECONDS": "2147483.647"},
    )
    assert config.tls_enabled and config.compress_ratios == (0, 2**20)


def test_unreadable_and_malformed_config_files_name_the_file(tmp_path: Path) -> None:
    cases = {"binary.toml": b"\xff\xfe = 1\n", "deep.toml": b"x = " + b"[" * 100_000 + b"]" * 100_000 + b"\n"}
    for name, blob in cases.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(ConfigError, match=f"config.*{name}"):
            load_config(env={}, config_file=tmp_path / name)
    with pytest.raises(ConfigError, match=r"config \(from env INDEXER_CONFIG\): cannot read /nonexistent.toml"):
        load_config(env={"INDEXER_CONFIG": "/nonexistent.toml"})
    with pytest.raises(ConfigError, match=r"config \(from flag --config\): cannot read .*Is a directory"):
        load_config(env={}, config_file=tmp_path)
