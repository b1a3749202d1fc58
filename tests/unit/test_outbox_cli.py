"""The SQLite outbox's commands (docs/outbox.md, docs/cli.md): ``outbox init`` and ``relay``."""

from __future__ import annotations

import signal
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner
from hybridq.cli import cli
from hybridq.outbox import Outbox

from tests.unit.test_outbox import TASK, db, dsn, journal_jobs, rows

__all__ = ["db"]  # the fixture, shared


def test_outbox_init_creates_the_table_once_and_prints_its_sql(tmp_path: Path) -> None:
    runner = CliRunner()
    url = f"sqlite:///{tmp_path}/new.db"
    first = runner.invoke(cli, ["outbox", "init", "--dsn", url])
    again = runner.invoke(cli, ["outbox", "init", "--dsn", url])
    assert (first.exit_code, again.exit_code) == (0, 0), first.output
    assert first.output.startswith("created table hybridq_outbox")
    assert again.output.startswith("exists: table hybridq_outbox")
    printed = runner.invoke(cli, ["outbox", "init", "--print-sql", "--table", "my_outbox"])
    assert printed.exit_code == 0
    with sqlite3.connect(tmp_path / "other.db") as conn:
        conn.executescript(printed.output)  # the printed DDL is runnable as is
        Outbox(table="my_outbox").enqueue(conn, TASK, 1, 2)


@pytest.mark.parametrize(
    "args",
    [
        ["outbox", "init", "--dsn", "mysql://u:pw@h/db"],
        ["outbox", "init", "--print-sql", "--dsn", "mysql://u:pw@h/db"],
        ["outbox", "init", "--dsn", "app.db"],
        ["outbox", "init", "--dsn", "sqlite:///missing-dir/app.db"],
        ["outbox", "init"],
        ["outbox", "init", "--dsn", "sqlite:///x.db", "--table", "bad-name"],
        ["relay", "--outbox", "mysql://h/db", "--once"],
        ["relay", "--outbox", "sqlite:///missing.db", "--once"],
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, [*args, "--journal", "j"] if args[0] == "relay" else args)
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1
    assert result.output.startswith("hybridq: error: ")
    assert "pw" not in result.output
    assert list(tmp_path.iterdir()) == []


def test_relay_without_the_table_is_one_line_exit_2(tmp_path: Path) -> None:
    sqlite3.connect(tmp_path / "app.db").close()
    result = CliRunner().invoke(
        cli, ["relay", "--outbox", f"sqlite:///{tmp_path}/app.db", "--journal", str(tmp_path / "j"), "--once"]
    )
    assert result.exit_code == 2
    assert "no table 'hybridq_outbox'" in result.output
    assert "outbox init" in result.output
    assert not (tmp_path / "j").exists()


def test_relay_once_relays_everything_and_exits_0(db: Path, journal_dir: Path) -> None:
    conn = sqlite3.connect(db)
    with conn:
        ids = [Outbox().enqueue(conn, TASK, i, 0) for i in range(7)]
    conn.close()
    result = CliRunner().invoke(
        cli, ["relay", "--outbox", dsn(db), "--journal", str(journal_dir), "--once", "--batch-size", "3"]
    )
    assert result.exit_code == 0, result.output
    assert [env.id for env in journal_jobs(journal_dir)] == ids
    assert rows(db) == []


@pytest.mark.parametrize("args", [["outbox"], ["outbox", "init"], ["relay"]])
def test_outbox_commands_have_help_with_an_example(args: list[str]) -> None:
    result = CliRunner().invoke(cli, [*args, "--help"])
    assert result.exit_code == 0
    assert "Example" in result.output
    assert "sqlite:///" in result.output


def test_relay_restores_the_signal_handlers_it_replaced(db: Path, journal_dir: Path) -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(cli, ["relay", "--outbox", dsn(db), "--journal", str(journal_dir), "--once"])
    assert result.exit_code == 0, result.output
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
