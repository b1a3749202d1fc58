"""``outbox.once`` (docs/outbox.md, "Exactly-once effects"): the done row and the effect commit together."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from hybridq.cli import cli
from hybridq.context import CurrentJob, _current
from hybridq.outbox import Outbox
from hybridq.outbox.once import create_done_table, done_ddl, prune_done

outbox = Outbox()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        assert create_done_table(conn) is True
        assert create_done_table(conn) is False
        conn.execute("CREATE TABLE sms (order_id INTEGER NOT NULL)")
    conn.close()
    return path


@pytest.fixture
def conn(db: Path) -> Iterator[sqlite3.Connection]:
    c = sqlite3.connect(db, timeout=5)
    yield c
    c.close()


def send(conn: sqlite3.Connection, order_id: int, key: str | None = None) -> bool:
    """The task's body: the effect (an sms row) only the first time its key is seen."""
    with conn, outbox.once(conn, key) as first:
        if first:
            conn.execute("INSERT INTO sms (order_id) VALUES (?)", (order_id,))
    return first


def fail_after_the_effect(conn: sqlite3.Connection, key: str) -> None:
    """A block that writes its effect, then fails (a provider error, a bug)."""
    with outbox.once(conn, key) as first:
        assert first
        conn.execute("INSERT INTO sms (order_id) VALUES (42)")
        raise KeyError("provider")


def effects(db: Path) -> int:
    with sqlite3.connect(db) as c:
        n = int(c.execute("SELECT count(*) FROM sms").fetchone()[0])
    c.close()
    return n


def done_rows(db: Path) -> list[tuple[str, str | None]]:
    with sqlite3.connect(db) as c:
        rows = c.execute(
            "SELECT idempotency_key, job_id FROM hybridq_done ORDER BY idempotency_key"
        ).fetchall()
    c.close()
    return rows


@pytest.fixture
def in_task() -> Iterator[CurrentJob]:
    job = CurrentJob(
        id="job-1", idempotency_key="sms:42", attempt=1, max_attempts=1, queue="default", func="app.send"
    )
    token = _current.set(job)
    yield job
    _current.reset(token)


def test_the_first_time_is_first_and_a_second_run_of_the_key_skips_the_effect(
    conn: sqlite3.Connection, db: Path
) -> None:
    assert send(conn, 42, "sms:42") is True
    assert send(conn, 42, "sms:42") is False
    assert send(conn, 43, "sms:43") is True
    assert effects(db) == 2
    assert done_rows(db) == [("sms:42", None), ("sms:43", None)]


def test_the_key_defaults_to_the_running_jobs_idempotency_key(
    conn: sqlite3.Connection, db: Path, in_task: CurrentJob
) -> None:
    assert send(conn, 42) is True
    assert send(conn, 42) is False  # a re-delivery of the same job
    assert effects(db) == 1
    assert done_rows(db) == [("sms:42", "job-1")]
    assert send(conn, 42, "other") is True  # an explicit key inside a task still names the job
    assert done_rows(db) == [("other", "job-1"), ("sms:42", "job-1")]


def test_outside_a_task_a_key_is_required_and_nothing_is_written(conn: sqlite3.Connection, db: Path) -> None:
    with pytest.raises(RuntimeError, match=r"outside a hybridq task needs a key"):
        outbox.once(conn)
    assert not conn.in_transaction
    assert done_rows(db) == []


@pytest.mark.parametrize("key", ["", 42, b"k"])
def test_a_bad_key_is_refused(conn: sqlite3.Connection, key: object) -> None:
    with pytest.raises(ValueError, match="non-empty string"):
        outbox.once(conn, key)  # type: ignore[arg-type]


def test_other_connection_types_and_bad_table_names_are_refused(conn: sqlite3.Connection) -> None:
    with pytest.raises(TypeError, match=r"sqlite3.Connection or psycopg.Connection"):
        outbox.once(object(), "k")
    with pytest.raises(ValueError, match="plain identifier"):
        outbox.once(conn, "k", table="done; DROP TABLE sms")


def test_an_exception_in_the_block_leaves_no_done_row_so_a_later_run_does_the_effect(
    conn: sqlite3.Connection, db: Path
) -> None:
    with pytest.raises(KeyError), conn:
        fail_after_the_effect(conn, "sms:42")
    assert (effects(db), done_rows(db)) == (0, [])
    assert send(conn, 42, "sms:42") is True
    assert effects(db) == 1


def test_an_exception_caught_outside_the_block_and_committed_records_neither_the_key_nor_the_effect(
    conn: sqlite3.Connection, db: Path
) -> None:
    with conn:
        conn.execute("INSERT INTO sms (order_id) VALUES (1)")  # the caller's own write, kept
        with contextlib.suppress(KeyError):
            fail_after_the_effect(conn, "sms:42")
    assert (effects(db), done_rows(db)) == (1, [])  # the block rolled back to its savepoint


def test_a_rollback_inside_the_block_leaves_no_done_row(conn: sqlite3.Connection, db: Path) -> None:
    with outbox.once(conn, "sms:42") as first:
        assert first
        conn.execute("INSERT INTO sms (order_id) VALUES (42)")
        conn.rollback()
    assert not conn.in_transaction
    assert (effects(db), done_rows(db)) == (0, [])
    assert send(conn, 42, "sms:42") is True


def test_the_done_row_is_part_of_the_callers_transaction(conn: sqlite3.Connection, db: Path) -> None:
    assert not conn.in_transaction
    with outbox.once(conn, "sms:42") as first:
        conn.execute("INSERT INTO sms (order_id) VALUES (42)")
    assert first
    assert conn.in_transaction  # still open after the block: the caller decides
    conn.execute("INSERT INTO sms (order_id) VALUES (1)")
    conn.rollback()
    assert (effects(db), done_rows(db)) == (0, [])


def test_in_autocommit_mode_the_block_is_its_own_transaction(db: Path) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        with pytest.raises(KeyError):
            fail_after_the_effect(conn, "sms:42")
        assert (effects(db), done_rows(db)) == (0, [])
        with outbox.once(conn, "sms:42") as first:
            conn.execute("INSERT INTO sms (order_id) VALUES (42)")
        assert first
        assert not conn.in_transaction  # committed when the block ended
        assert (effects(db), len(done_rows(db))) == (1, 1)
    finally:
        conn.close()


def test_two_keys_in_one_transaction(conn: sqlite3.Connection, db: Path) -> None:
    with conn, outbox.once(conn, "a") as first_a:
        with outbox.once(conn, "b") as first_b:
            pass
        with outbox.once(conn, "b") as again_b:
            pass
    assert (first_a, first_b, again_b) == (True, True, False)
    assert [k for k, _ in done_rows(db)] == ["a", "b"]


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_a_concurrent_run_of_the_key_waits_and_makes_no_second_effect(db: Path, outcome: str) -> None:
    a, b = sqlite3.connect(db, timeout=10), sqlite3.connect(db, timeout=10, check_same_thread=False)
    seen: list[bool] = []
    try:
        block = outbox.once(a, "sms:42")
        assert block.__enter__() is True  # holds SQLite's write lock until the commit
        a.execute("INSERT INTO sms (order_id) VALUES (42)")
        rival = threading.Thread(target=lambda: seen.append(send(b, 42, "sms:42")))
        rival.start()
        time.sleep(0.3)
        assert seen == []  # waiting for the lock
        block.__exit__(None, None, None)
        if outcome == "commit":
            a.commit()
        else:
            a.rollback()
        rival.join(10)
    finally:
        a.close()
        b.close()
    assert seen == [outcome == "rollback"]
    assert effects(db) == 1


@pytest.mark.parametrize("journal_mode", ["delete", "wal"])
def test_a_concurrent_run_whose_transaction_read_first_fails_and_makes_no_second_effect(
    db: Path, journal_mode: str
) -> None:
    a, b = sqlite3.connect(db, timeout=10), sqlite3.connect(db, timeout=10, check_same_thread=False)
    a.execute(f"PRAGMA journal_mode = {journal_mode}")
    errors: list[BaseException] = []
    read, inserted = threading.Event(), threading.Event()

    def rival() -> None:
        try:
            with b:
                b.execute("BEGIN")
                b.execute("SELECT count(*) FROM sms").fetchone()  # a read: its snapshot predates a's commit
                read.set()
                inserted.wait(10)
                with outbox.once(b, "sms:42") as first:
                    if first:
                        b.execute("INSERT INTO sms (order_id) VALUES (42)")
        except sqlite3.OperationalError as exc:
            errors.append(exc)

    try:
        thread = threading.Thread(target=rival)
        thread.start()
        read.wait(10)
        with a:
            with outbox.once(a, "sms:42") as first:
                a.execute("INSERT INTO sms (order_id) VALUES (42)")
            inserted.set()
            time.sleep(0.3)
        thread.join(20)
        assert first
        assert send(b, 42, "sms:42") is False  # the task's retry
    finally:
        a.close()
        b.close()
    # Rollback journal: b may not wait for a lock while holding its read lock (a deadlock);
    # WAL: b's snapshot is older than a's commit. Either way b cannot write on a stale read.
    assert [str(e) for e in errors] == ["database is locked"]
    assert effects(db) == 1


def test_a_missing_table_says_how_to_create_it(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "empty.db")
    try:
        with pytest.raises(sqlite3.OperationalError, match=r"no such table: hybridq_done: create it with"):
            outbox.once(conn, "k").__enter__()
    finally:
        conn.close()


def test_prune_deletes_only_old_rows(conn: sqlite3.Connection, db: Path) -> None:
    send(conn, 1, "old")
    send(conn, 2, "new")
    with conn:
        conn.execute("UPDATE hybridq_done SET done_at = done_at - 100 * 86400 WHERE idempotency_key = 'old'")
    with conn:
        assert prune_done(conn, 30 * 86400) == 1
    assert [k for k, _ in done_rows(db)] == ["new"]
    assert send(conn, 1, "old") is True  # a pruned key protects nothing any more


def test_outbox_init_creates_the_done_table_too(tmp_path: Path) -> None:
    runner = CliRunner()
    url = f"sqlite:///{tmp_path}/new.db"
    first = runner.invoke(cli, ["outbox", "init", "--dsn", url, "--done-table", "my_done"])
    assert first.exit_code == 0, first.output
    assert "created table my_done" in first.output
    again = runner.invoke(cli, ["outbox", "init", "--dsn", url, "--done-table", "my_done"])
    assert "exists: table my_done" in again.output
    conn = sqlite3.connect(tmp_path / "new.db")
    try:
        with conn, Outbox().once(conn, "k", table="my_done") as first_time:
            pass
        assert first_time
    finally:
        conn.close()
    printed = runner.invoke(cli, ["outbox", "init", "--print-sql"])
    assert done_ddl() in printed.output
    bad = runner.invoke(cli, ["outbox", "init", "--dsn", url, "--done-table", "bad-name"])
    assert bad.exit_code == 2
