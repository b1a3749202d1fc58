"""``outbox.once`` on PostgreSQL through psycopg 3 (docs/outbox.md, "Exactly-once effects: once()").

Runs against the suite's own PostgreSQL server (``pg_dsn``: a fresh database per test,
tests/support/postgres.py); skipped only when no server can be started.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hybridq.outbox import Outbox
from hybridq.outbox.once import create_done_table, prune_done

psycopg = pytest.importorskip("psycopg")

outbox = Outbox()
TABLE = "hybridq_done_test"


@pytest.fixture
def admin(pg_dsn: str) -> Iterator[Any]:
    conn = psycopg.connect(pg_dsn, autocommit=True)
    conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
    conn.execute("DROP TABLE IF EXISTS once_sms")
    assert create_done_table(conn, TABLE) is True
    assert create_done_table(conn, TABLE) is False
    conn.execute("CREATE TABLE once_sms (order_id INTEGER NOT NULL)")
    yield conn
    conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
    conn.execute("DROP TABLE IF EXISTS once_sms")
    conn.close()


@pytest.fixture
def connect(pg_dsn: str, admin: Any) -> Iterator[Any]:
    opened: list[Any] = []

    def make(**options: Any) -> Any:
        opened.append(psycopg.connect(pg_dsn, **options))
        return opened[-1]

    yield make
    for conn in opened:
        conn.close()


def send(conn: Any, key: str, order_id: int = 42) -> bool:
    with outbox.once(conn, key, table=TABLE) as first:
        if first:
            conn.execute("INSERT INTO once_sms (order_id) VALUES (%s)", (order_id,))
    return first


def fail_after_the_effect(conn: Any, key: str) -> None:
    with outbox.once(conn, key, table=TABLE):
        conn.execute("INSERT INTO once_sms (order_id) VALUES (7)")
        raise KeyError("provider")


def count(admin: Any, where: str = "TRUE") -> tuple[int, int]:
    """(effects, done rows), committed."""
    sms = admin.execute(f"SELECT count(*) FROM once_sms WHERE {where}").fetchone()[0]
    done = admin.execute(f"SELECT count(*) FROM {TABLE}").fetchone()[0]
    return int(sms), int(done)


def test_first_then_duplicate_in_the_callers_transaction(connect: Any, admin: Any) -> None:
    conn = connect()
    assert send(conn, "sms:42") is True
    assert count(admin) == (0, 0)  # not committed yet
    conn.commit()
    assert send(conn, "sms:42") is False
    conn.commit()
    assert count(admin) == (1, 1)
    assert send(conn, "sms:43") is True
    conn.rollback()
    assert count(admin) == (1, 1)  # rolled back: no row, a later run does the effect


def test_an_exception_in_the_block_rolls_back_its_key_and_its_writes(connect: Any, admin: Any) -> None:
    conn = connect()
    with contextlib.suppress(KeyError):
        fail_after_the_effect(conn, "k")
    conn.commit()
    assert count(admin) == (0, 0)
    with contextlib.suppress(psycopg.errors.DivisionByZero), outbox.once(conn, "k", table=TABLE):
        conn.execute("SELECT 1 / 0")  # aborts the transaction: the savepoint restores it
    assert conn.execute("SELECT 1").fetchone() == (1,)
    conn.commit()


def test_an_autocommit_connection_gets_a_transaction_of_the_blocks_own(connect: Any, admin: Any) -> None:
    conn = connect(autocommit=True)
    with contextlib.suppress(KeyError):
        fail_after_the_effect(conn, "k")
    assert count(admin) == (0, 0)
    assert send(conn, "k") is True
    assert count(admin) == (1, 1)  # committed when the block ended


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_a_concurrent_run_waits_for_the_first_and_makes_no_second_effect(
    connect: Any, admin: Any, outcome: str
) -> None:
    a, b = connect(), connect()
    block = outbox.once(a, "sms:42", table=TABLE)
    assert block.__enter__() is True
    a.execute("INSERT INTO once_sms (order_id) VALUES (42)")
    seen: list[bool] = []
    rival = threading.Thread(target=lambda: (seen.append(send(b, "sms:42")), b.commit()))
    rival.start()
    time.sleep(0.3)
    assert seen == []  # waiting on the first's uncommitted key
    block.__exit__(None, None, None)
    getattr(a, outcome)()
    rival.join(10)
    assert seen == [outcome == "rollback"]
    assert count(admin) == (1, 1)


def test_at_repeatable_read_a_concurrent_run_fails_and_makes_no_second_effect(
    connect: Any, admin: Any
) -> None:
    a, b = connect(), connect()
    b.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    b.execute("SELECT 1")  # its snapshot predates a's commit
    errors: list[BaseException] = []

    def rival() -> None:
        try:
            send(b, "sms:42")
        except psycopg.errors.SerializationFailure as exc:
            errors.append(exc)
        b.rollback()

    block = outbox.once(a, "sms:42", table=TABLE)
    assert block.__enter__() is True
    a.execute("INSERT INTO once_sms (order_id) VALUES (42)")
    thread = threading.Thread(target=rival)
    thread.start()
    time.sleep(0.3)
    block.__exit__(None, None, None)
    a.commit()
    thread.join(10)
    assert len(errors) == 1
    assert send(b, "sms:42") is False  # its retry
    b.commit()
    assert count(admin) == (1, 1)


def test_prune(connect: Any, admin: Any) -> None:
    conn = connect()
    send(conn, "old")
    send(conn, "new")
    conn.execute(f"UPDATE {TABLE} SET done_at = done_at - 100 * 86400 WHERE idempotency_key = 'old'")
    assert prune_done(conn, 30 * 86400, table=TABLE) == 1
    conn.commit()
    assert count(admin)[1] == 1


def _counts(admin: Any) -> tuple[int, int]:
    row = admin.execute(f"SELECT (SELECT count(*) FROM {TABLE}), (SELECT count(*) FROM once_sms)").fetchone()
    return int(row[0]), int(row[1])


@pytest.mark.parametrize("autocommit", [False, True])
def test_in_pipeline_mode_the_first_run_does_the_effect(connect: Any, admin: Any, autocommit: bool) -> None:
    """psycopg's pipeline mode has no rowcount yet: the key was recorded and the effect skipped for good."""
    conn = connect(autocommit=autocommit)
    with conn.pipeline():
        assert send(conn, "order:1") is True
    conn.commit()
    assert _counts(admin) == (1, 1)


def test_a_commit_inside_the_block_then_more_statements_leaves_both_committed(
    connect: Any, admin: Any
) -> None:
    """Leaving the block released a savepoint the commit had ended: the task failed after its effect."""
    conn = connect()
    with outbox.once(conn, "order:2", table=TABLE) as first:
        assert first
        conn.execute("INSERT INTO once_sms (order_id) VALUES (2)")
        conn.commit()
        conn.execute("SELECT 1")
    conn.commit()
    assert _counts(admin) == (1, 1)


def test_an_async_connection_is_refused_up_front(pg_dsn: str) -> None:
    async def check() -> None:
        aconn = await psycopg.AsyncConnection.connect(pg_dsn)
        try:
            with pytest.raises(TypeError, match="AsyncConnection"):
                outbox.once(aconn, "order:3", table=TABLE)
        finally:
            await aconn.close()

    import asyncio

    asyncio.run(check())
