"""The outbox on PostgreSQL (docs/outbox.md): psycopg 3 and SQLAlchemy connections, the relay.

Every test runs against a real PostgreSQL the suite starts itself (tests/support/postgres.py).
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import psycopg
import pytest
import sqlalchemy
import sqlalchemy.orm
from click.testing import CliRunner
from hybridq import NotSerializable
from hybridq.cli import cli
from hybridq.envelope import Envelope
from hybridq.outbox import Outbox
from hybridq.outbox.schema import connect, create_table, dialect_of, redact

from tests.support.postgres import PostgresServer
from tests.unit.test_outbox import TASK


def test_each_test_gets_a_fresh_database_on_a_private_server(
    postgres_server: PostgresServer, pg_dsn: str
) -> None:
    assert "host=/tmp/" in pg_dsn
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone() == (0,)
        assert conn.execute("SHOW listen_addresses").fetchone() == ("",)
    print(postgres_server.version)


def pg_rows(dsn: str, table: str = "hybridq_outbox") -> list[tuple[str, str, int]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f"SELECT job_id, idempotency_key, relaying FROM {table} ORDER BY id").fetchall()


@pytest.fixture
def pg(pg_dsn: str) -> str:
    """A fresh database with the outbox table and an orders table; its DSN."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert Outbox().create_table(conn) is True
        assert Outbox().create_table(conn) is False  # idempotent
        conn.execute("CREATE TABLE orders (id serial PRIMARY KEY, state text)")
    return pg_dsn


def test_psycopg_the_row_commits_and_rolls_back_with_the_callers_transaction(pg: str) -> None:
    outbox = Outbox()
    with psycopg.connect(pg) as conn:
        with conn.transaction():
            conn.execute("INSERT INTO orders (state) VALUES ('complete')")
            job_id = outbox.enqueue(conn, TASK, 1, 2, idempotency_key="order:1:sms", queue="sms")

        def failed_order() -> None:
            with conn.transaction():
                conn.execute("INSERT INTO orders (state) VALUES ('complete')")
                outbox.enqueue(conn, TASK, 3, 4)
                raise RuntimeError("the order failed")

        with pytest.raises(RuntimeError):
            failed_order()
        outbox.enqueue(conn, TASK, 5, 6)  # psycopg's implicit transaction, never committed
        conn.rollback()
    assert pg_rows(pg) == [(job_id, "order:1:sms", 0)]
    with psycopg.connect(pg) as conn:
        [(payload, created_at)] = conn.execute("SELECT envelope, created_at FROM hybridq_outbox").fetchall()
    env = Envelope.from_bytes(payload)
    assert (env.id, env.func, env.args, env.queue) == (job_id, TASK, (1, 2), "sms")
    assert isinstance(created_at, float)
    assert abs(created_at - time.time()) < 60


def test_psycopg_a_bad_call_raises_before_anything_is_written(pg: str) -> None:
    with psycopg.connect(pg) as conn:
        with pytest.raises(NotSerializable):
            Outbox().enqueue(conn, TASK, object())
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE  # not even a BEGIN
        conn.commit()
    assert pg_rows(pg) == []


def test_psycopg_a_missing_table_says_how_to_create_it(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn) as conn, pytest.raises(psycopg.errors.UndefinedTable) as info:
        Outbox().enqueue(conn, TASK, 1, 2)
    assert any("hybridq outbox init --dsn postgresql://" in note for note in info.value.__notes__)


def sqlalchemy_engines(pg: str, tmp_path: Path) -> dict[str, sqlalchemy.engine.Engine]:
    sqlite_db = tmp_path / "app.db"
    with sqlite3.connect(sqlite_db) as conn:
        Outbox().create_table(conn)
    return {
        "postgresql": sqlalchemy.create_engine(pg.replace("postgresql://", "postgresql+psycopg://", 1)),
        "sqlite": sqlalchemy.create_engine(f"sqlite:///{sqlite_db}"),
    }


def sa_job_ids(engine: sqlalchemy.engine.Engine) -> list[str]:
    with engine.connect() as conn:
        return [
            job for (job,) in conn.execute(sqlalchemy.text("SELECT job_id FROM hybridq_outbox ORDER BY id"))
        ]


@pytest.mark.parametrize("database", ["postgresql", "sqlite"])
def test_sqlalchemy_connection_commits_and_rolls_back_the_row(pg: str, tmp_path: Path, database: str) -> None:
    engine = sqlalchemy_engines(pg, tmp_path)[database]
    outbox = Outbox()
    try:
        with engine.begin() as conn:
            committed = outbox.enqueue(conn, TASK, 1, 2, idempotency_key="k1")

        def failed() -> None:
            with engine.begin() as conn:
                outbox.enqueue(conn, TASK, 3, 4)
                raise RuntimeError("rolled back")

        with pytest.raises(RuntimeError):
            failed()
        with engine.connect() as conn:
            outbox.enqueue(conn, TASK, 5, 6)
            conn.rollback()
        assert sa_job_ids(engine) == [committed]
    finally:
        engine.dispose()


@pytest.mark.parametrize("database", ["postgresql", "sqlite"])
def test_sqlalchemy_session_commits_and_rolls_back_the_row(pg: str, tmp_path: Path, database: str) -> None:
    engine = sqlalchemy_engines(pg, tmp_path)[database]
    outbox = Outbox()
    try:
        with sqlalchemy.orm.Session(engine) as session, session.begin():
            committed = outbox.enqueue(session, TASK, 1, 2)
        with sqlalchemy.orm.Session(engine) as session:
            outbox.enqueue(session, TASK, 3, 4)
            session.rollback()

        def failed() -> None:
            with sqlalchemy.orm.Session(engine) as session, session.begin():
                outbox.enqueue(session, TASK, 5, 6)
                raise RuntimeError("rolled back")

        with pytest.raises(RuntimeError):
            failed()
        assert sa_job_ids(engine) == [committed]
        with engine.connect() as conn:
            [payload] = conn.execute(sqlalchemy.text("SELECT envelope FROM hybridq_outbox")).scalars()
        assert Envelope.from_bytes(bytes(payload)).id == committed
    finally:
        engine.dispose()


def test_sqlalchemy_a_missing_table_says_how_to_create_it(pg_dsn: str) -> None:
    engine = sqlalchemy.create_engine(pg_dsn.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with pytest.raises(sqlalchemy.exc.ProgrammingError) as info, engine.begin() as conn:
            Outbox().enqueue(conn, TASK, 1)
        assert any("hybridq outbox init" in note for note in info.value.__notes__)
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("value", "dialect"),
    [
        ("sqlite:///app.db", "sqlite"),
        ("postgresql://u:pw@h:5433/db", "postgresql"),
        ("postgres://h/db", "postgresql"),
        ("postgresql:///db?host=/tmp/x", "postgresql"),
    ],
)
def test_dsn_dialects(value: str, dialect: str) -> None:
    assert dialect_of(value) == dialect
    assert "pw" not in redact(value)


def test_connect_gives_an_autocommit_connection_for_either_dsn(pg: str, tmp_path: Path) -> None:
    sqlite_db = tmp_path / "app.db"
    sqlite3.connect(sqlite_db).close()
    for dsn in (pg, f"sqlite:///{sqlite_db}"):
        conn = connect(dsn)
        try:
            create_table(conn)
            count, oldest = conn.execute("SELECT count(*), min(created_at) FROM hybridq_outbox").fetchone()
            assert (count, oldest) == (0, None)
        finally:
            conn.close()


def test_connect_to_no_server_is_one_line_without_the_password(tmp_path: Path) -> None:
    with pytest.raises(ConnectionError) as info:
        connect(f"postgresql://u:secret@/db?host={tmp_path}")
    assert "secret" not in str(info.value)
    assert "\n" not in str(info.value)


def test_outbox_init_creates_the_table_on_postgresql_once_and_prints_its_ddl(pg_dsn: str) -> None:
    runner = CliRunner()
    first = runner.invoke(cli, ["outbox", "init", "--dsn", pg_dsn])
    again = runner.invoke(cli, ["outbox", "init", "--dsn", pg_dsn])
    assert (first.exit_code, again.exit_code) == (0, 0), first.output
    assert first.output.startswith("created table hybridq_outbox in postgresql://")
    assert again.output.startswith("exists: table hybridq_outbox")
    printed = runner.invoke(
        cli, ["outbox", "init", "--print-sql", "--dsn", "postgresql://", "--table", "my_outbox"]
    )
    assert printed.exit_code == 0
    assert "bigserial" in printed.output
    assert "bytea" in printed.output
    assert "pg_notify('my_outbox'" in printed.output
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(printed.output)  # runnable as is
        conn.execute(printed.output)  # and again (idempotent)
        conn.commit()
        Outbox(table="my_outbox").enqueue(conn, TASK, 1, 2)
        conn.commit()
        columns = conn.execute(
            "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = 'hybridq_outbox'"
        ).fetchall()
    assert ("created_at", "double precision") in columns
    assert pg_rows(pg_dsn, "my_outbox")[0][2] == 0


def test_outbox_init_on_an_unreachable_server_is_one_line_exit_1(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["outbox", "init", "--dsn", f"postgresql://u:secret@/db?host={tmp_path}"]
    )
    assert result.exit_code == 1
    assert result.output.count("\n") == 1
    assert result.output.startswith("hybridq: error: cannot connect to PostgreSQL")
    assert "secret" not in result.output


def test_an_insert_notifies_the_tables_channel_at_commit(pg: str) -> None:
    with psycopg.connect(pg, autocommit=True) as listener, psycopg.connect(pg) as app:
        listener.execute("LISTEN hybridq_outbox")
        with app.transaction():
            Outbox().enqueue(app, TASK, 1)
            Outbox().enqueue(app, TASK, 2)
            assert list(listener.notifies(timeout=0.2)) == []  # not before the commit
        got = list(listener.notifies(timeout=5, stop_after=1))
        assert [n.channel for n in got] == ["hybridq_outbox"]
