"""The TLS settings' checks: they go together, and their files load as PEM, at load time."""

from __future__ import annotations

import re
import ssl
from collections.abc import Mapping
from pathlib import Path

from indexer_service.service.config.settings import ConfigError, ServiceConfig, _one_line


def validate_tls(config: ServiceConfig, sources: Mapping[str, str]) -> None:
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
