"""A signing key variable set but empty is an error, not signing turned off (issue 13.10)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from hybridq import Queue
from hybridq.cli import cli
from hybridq.journal import JournalReader
from hybridq.signing import ENV_KEY, ENV_KEY_FILE, SigningKeyError, keyring


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
