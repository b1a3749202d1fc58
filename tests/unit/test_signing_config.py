"""A signing key variable set but empty is an error, not signing turned off (issue 13.10)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from hybridq import Queue
from hybridq.cli import cli
from hybridq.errors import SigningKeyError
from hybridq.journal import JournalReader
from hybridq.security.signing import ENV_KEY, ENV_KEY_FILE, keyring


@pytest.fixture(autouse=True)
def _no_key_from_the_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_KEY, raising=False)
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)


@pytest.mark.parametrize("name", [ENV_KEY_FILE, ENV_KEY])
@pytest.mark.parametrize("value", ["", "  "])
def test_a_key_variable_set_but_empty_is_an_error(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SigningKeyError, match=f"{name} is set but empty") as caught:
        keyring()
    assert "\n" not in str(caught.value)


def test_an_unset_key_variable_is_signing_off() -> None:
    assert keyring() is None


def test_an_empty_key_file_variable_stops_the_worker_and_the_enqueue(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_KEY_FILE, "")
    result = CliRunner().invoke(cli, ["worker", "--burst", "--redis", "redis://127.0.0.1:1/0", "q"])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("hybridq: error: ")
    assert f"{ENV_KEY_FILE} is set but empty" in result.output
    assert "Traceback" not in result.output
    with pytest.raises(SigningKeyError):
        Queue("default", journal_dir).enqueue("tests.tasks.add", 1, 2)
    assert not journal_dir.exists() or list(JournalReader(journal_dir).records()) == []


def test_signing_adds_an_expiry_from_the_configured_ttl(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridq.envelope.model import Envelope
    from hybridq.security.signing import Keyring, expiry_refusal

    ring = Keyring((b"k" * 32,))
    env = Envelope(id="j1", func="m.f", queue="q", idempotency_key="k", created_at=1000.0)
    assert ring.sign(env).extra["not_after"] == 1000.0 + 7 * 86400
    monkeypatch.setenv("HYBRIDQ_SIGNATURE_TTL", "60")
    signed = ring.sign(env)
    assert signed.extra["not_after"] == 1060.0
    delayed = ring.sign(
        Envelope(id="j2", func="m.f", queue="q", idempotency_key="k", created_at=1000.0, run_at=5000.0)
    )
    assert delayed.extra["not_after"] == 5060.0
    assert expiry_refusal(signed, now=1060.0) is None
    refused = expiry_refusal(signed, now=1060.5)
    assert refused is not None
    assert "expired at 1970-01-01T00:17:40Z" in str(refused)


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", "nan"])
def test_a_bad_signature_ttl_is_a_configuration_error(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_KEY, "k" * 32)
    monkeypatch.setenv("HYBRIDQ_SIGNATURE_TTL", value)
    with pytest.raises(SigningKeyError, match="HYBRIDQ_SIGNATURE_TTL="):
        keyring()
