"""The outbox backlog in ``status`` and the relay inside the forwarder (docs/outbox.md).

``hybridq status --outbox DSN`` and ``hybridq forward --outbox DSN`` (its start-up checks, and
:class:`BackgroundRelay`, the thread that runs the relay in the forwarder's process).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hybridq.cli import cli
from hybridq.journal import JournalReader
from hybridq.journal.paths import ensure_journal_dir
from hybridq.outbox import Outbox
from hybridq.outbox.background import BackgroundRelay
from hybridq.outbox.backlog import Backlog, query_backlog, read_backlog

TASK = "tests.tasks.add"


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        Outbox().create_table(conn)
    return path


def dsn(db: Path) -> str:
    return f"sqlite:///{db}"


def commit(db: Path, n: int, *, age_s: float = 0.0, table: str = "hybridq_outbox") -> None:
    """Commit ``n`` outbox rows, as if inserted ``age_s`` seconds ago."""
    with sqlite3.connect(db) as conn:
        for i in range(n):
            Outbox(table=table).enqueue(conn, TASK, i, i)
        conn.execute(f"UPDATE {table} SET created_at = created_at - ?", (age_s,))


def journal_records(journal: Path) -> int:
    return sum(1 for _ in JournalReader(journal).records()) if journal.exists() else 0


class CursorOnly:
    """A DB-API connection with nothing but ``cursor()`` (no sqlite3 ``execute`` shortcut)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def cursor(self) -> Any:
        return self._conn.cursor()


def test_the_backlog_is_the_row_count_and_the_oldest_rows_age(db: Path) -> None:
    assert read_backlog(dsn(db), "hybridq_outbox") == Backlog(0, None)
    assert Backlog(0, None).oldest_age_s() == 0.0
    commit(db, 3, age_s=120)
    commit(db, 2)
    backlog = query_backlog(CursorOnly(sqlite3.connect(db)), "hybridq_outbox")
    assert backlog.rows == 5
    assert 120 <= backlog.oldest_age_s() < 180
    assert backlog.oldest_created_at is not None
    assert backlog.oldest_age_s(now=backlog.oldest_created_at - 5) == 0.0  # a clock step back
    with pytest.raises(ValueError, match="not a plain identifier"):
        read_backlog(dsn(db), "x; DROP TABLE y")


def test_status_shows_the_backlog_and_keeps_every_other_key(db: Path, journal_dir: Path) -> None:
    ensure_journal_dir(journal_dir)
    commit(db, 4, age_s=90)
    runner = CliRunner()
    plain = json.loads(runner.invoke(cli, ["status", "--json", "--journal", str(journal_dir)]).output)
    result = runner.invoke(cli, ["status", "--json", "--journal", str(journal_dir), "--outbox", dsn(db)])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert set(out) - set(plain) == {"outbox"}  # a key added, none changed or removed
    assert {k: v for k, v in out.items() if k != "outbox"} == plain
    assert out["outbox"]["rows"] == 4
    assert 90 <= out["outbox"]["oldest_age_s"] < 150
    assert out["outbox"]["table"] == "hybridq_outbox"
    assert out["outbox"]["dsn"] == dsn(db)
    text = runner.invoke(
        cli, ["status", "--journal", str(journal_dir)], env={"HYBRIDQ_OUTBOX": dsn(db)}
    ).output
    assert "outbox: 4 rows not yet relayed, oldest 9" in text


@pytest.mark.parametrize("command", ["status", "forward"])
@pytest.mark.parametrize(
    ("outbox", "table", "message"),
    [
        ("mysql://h/db", "hybridq_outbox", "not supported"),
        ("sqlite:///missing.db", "hybridq_outbox", "does not exist"),
        ("sqlite:///app.db", "other", "no outbox table 'other'|no table 'other'"),
        ("sqlite:///app.db", "bad-name", "not a plain identifier"),
    ],
)
def test_a_bad_outbox_is_one_line_exit_2_and_writes_nothing(
    db: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    outbox: str,
    table: str,
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    journal = tmp_path / "journal"
    if command == "status":
        ensure_journal_dir(journal)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    args = [command, "--journal", str(journal), "--outbox", outbox, "--outbox-table", table]
    result = CliRunner().invoke(cli, [*args, "--redis", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1
    assert result.output.startswith("hybridq: error: ")
    assert any(m in result.output for m in message.split("|")), result.output
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no journal, no lock file


@pytest.mark.parametrize("command", ["status", "forward"])
def test_a_file_that_is_not_a_database_is_one_line_exit_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.db").write_text("not a database\n")
    journal = tmp_path / "journal"
    if command == "status":
        ensure_journal_dir(journal)
    args = [command, "--journal", str(journal), "--outbox", "sqlite:///notes.db"]
    result = CliRunner().invoke(cli, [*args, "--redis", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 1, result.output
    assert result.output == "hybridq: error: outbox sqlite:///notes.db: file is not a database\n"
    assert (command == "status") == journal.exists()


def test_a_failing_relay_is_logged_once_retried_and_works_again(
    db: Path, journal_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="hybridq.relay")
    relay = BackgroundRelay(dsn(db), str(journal_dir), poll_s=0.01, backoff_s=(0.01, 0.05))
    relay.open()
    relay.start()
    try:
        commit(db, 3)
        wait_for(lambda: relay.relayed == 3)
        with sqlite3.connect(db) as conn:  # the relay's table vanishes under it
            conn.execute("DROP TABLE hybridq_outbox")
        wait_for(lambda: relay.failures >= 5)
        assert relay.failing_since is not None
        with sqlite3.connect(db) as conn:
            Outbox().create_table(conn)
        commit(db, 2)
        wait_for(lambda: relay.relayed == 5)
        assert relay.failing_since is None
    finally:
        relay.stop()
        assert relay.join(10)
        relay.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert "outbox relay failed (OperationalError: no such table" in errors[0]
    assert "forwarding continues" in errors[0]
    assert any("outbox relay working again after" in r.getMessage() for r in caplog.records)
    assert caplog.records[-1].getMessage() == "stopped; relayed 5 jobs"
    assert journal_records(journal_dir) == 5
    assert read_backlog(dsn(db), "hybridq_outbox").rows == 0


def test_a_stopped_relay_finishes_and_releases_the_outbox(db: Path, journal_dir: Path) -> None:
    first = BackgroundRelay(dsn(db), str(journal_dir), poll_s=0.01)
    first.open()
    first.start()
    commit(db, 2)
    wait_for(lambda: first.relayed == 2)
    first.stop()
    assert first.join(10)
    first.close()
    first.close()  # idempotent
    second = BackgroundRelay(dsn(db), str(journal_dir))  # the lock was released
    second.open()
    second.close()
    assert first.relayed == 2


def wait_for(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_backlog_read_gives_up_on_a_locked_database_within_a_scrape(tmp_path: Path) -> None:
    """A migration's exclusive lock costs the backlog read 2 s, not a 30 s busy timeout.

    The whole metrics scrape waited 30 s behind it (Prometheus gives up after 10 s by default:
    every forwarder metric was lost; found in review).
    """
    from hybridq.outbox.backlog import READ_TIMEOUT_S, read_backlog
    from hybridq.outbox.schema import connect, create_table

    dsn = f"sqlite:///{tmp_path / 'app.db'}"
    conn = connect(dsn, create=True)
    create_table(conn)
    conn.close()
    app = sqlite3.connect(tmp_path / "app.db", isolation_level=None)
    app.execute("BEGIN EXCLUSIVE")
    started = time.monotonic()
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            read_backlog(dsn, "hybridq_outbox")
    finally:
        app.execute("ROLLBACK")
        app.close()
    assert READ_TIMEOUT_S <= 2.0
    assert time.monotonic() - started < 10.0  # the scrape's budget; it was 30 s
