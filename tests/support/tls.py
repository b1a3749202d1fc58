"""Throwaway certificate authorities and server certificates for TLS tests (``openssl`` CLI).

``make_certificates(directory, name)`` writes ``<name>-ca.pem`` (a self-signed CA) and a server
certificate it signed for ``127.0.0.1`` and ``localhost``, with its key, all valid for two days.
Every call makes a new CA, so two calls give two authorities that do not trust each other's
certificates. Tests that need it skip when no ``openssl`` binary is on PATH.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["Certificates", "make_certificates", "server_context"]

#: What the server certificate is valid for: redis-py checks the host name by default.
SUBJECT_ALT_NAME = "subjectAltName=IP:127.0.0.1,DNS:localhost"


@dataclass(frozen=True)
class Certificates:
    """Paths of a CA certificate and of a server certificate and key it signed."""

    ca: Path
    cert: Path
    key: Path


def _openssl(*args: str | Path) -> None:
    done = subprocess.run(
        ["openssl", *map(str, args)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"openssl {' '.join(map(str, args))} failed:\n{done.stderr}"


def make_certificates(directory: Path, name: str = "test") -> Certificates:
    """A new CA and a server certificate for 127.0.0.1 it signed, as PEM files in ``directory``."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary to make test certificates with")
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / f"{name}-ca.pem", directory / f"{name}-ca.key"
    cert, key, csr = (
        directory / f"{name}-server.pem",
        directory / f"{name}-server.key",
        directory / f"{name}.csr",
    )
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", f"/CN=hybridq {name} CA",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    _openssl("req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1")
    extensions = directory / f"{name}-server.ext"
    extensions.write_text(
        f"{SUBJECT_ALT_NAME}\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\nauthorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n"
    )
    _openssl(
        "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
        "-days", "2", "-extfile", extensions,
    )  # fmt: skip
    return Certificates(ca, cert, key)


def server_context(certs: Certificates) -> ssl.SSLContext:
    """A server-side TLS context presenting ``certs``' server certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.cert, certs.key)
    return context
