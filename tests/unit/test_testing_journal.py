"""No journal in the working directory unless one is configured (issue 17, docs/testing.md)."""

from __future__ import annotations

from pathlib import Path

import hybridq
import pytest
from hybridq.errors import ConfigError


@hybridq.task()
def noop() -> None:
    return None


@pytest.fixture
def bare_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory, and no HYBRIDQ_JOURNAL."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYBRIDQ_JOURNAL", raising=False)
    monkeypatch.setattr(noop, "_queue", None)  # resolved again from this environment
    return tmp_path


def test_enqueue_without_a_journal_raises_a_one_line_error_and_creates_nothing(bare_cwd: Path) -> None:
    queue = hybridq.Queue("default")  # made at import time in most apps: not an error yet
    with pytest.raises(ConfigError) as info:
        queue.enqueue(noop)
    message = str(info.value)
    assert "\n" not in message
    assert "journal=" in message
    assert "HYBRIDQ_JOURNAL" in message
    assert "hybridq.testing" in message
    assert list(bare_cwd.iterdir()) == []


def test_delay_without_a_journal_raises_and_creates_nothing(bare_cwd: Path) -> None:
    with pytest.raises(ConfigError, match="HYBRIDQ_JOURNAL"):
        noop.delay()
    with pytest.raises(ConfigError, match="no journal configured"):
        _ = hybridq.Queue().journal
    assert list(bare_cwd.iterdir()) == []


def test_a_journal_given_or_set_later_is_used(bare_cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    queue = hybridq.Queue("default")
    monkeypatch.setenv("HYBRIDQ_JOURNAL", str(bare_cwd / "from-env"))
    assert queue.enqueue(noop).journal == str(bare_cwd / "from-env")
    explicit = hybridq.Queue("default", journal=bare_cwd / "explicit")
    assert explicit.enqueue(noop).journal == str(bare_cwd / "explicit")
    assert sorted(p.name for p in bare_cwd.iterdir()) == ["explicit", "from-env"]
