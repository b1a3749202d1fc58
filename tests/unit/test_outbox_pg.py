"""The outbox on PostgreSQL (docs/outbox.md): psycopg 3 and SQLAlchemy connections, the relay.

Every test runs against a real PostgreSQL the suite starts itself (tests/support/postgres.py).
"""

from __future__ import annotations

import collections
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy
import sqlalchemy.orm
from click.testing import CliRunner
from hybridq import JournalLocked, NotSerializable
from hybridq.cli import cli
from hybridq.envelope.model import Envelope
from hybridq.journal import JournalReader, JournalWriter
from hybridq.outbox import Outbox
from hybridq.outbox import pg as pg_module
from hybridq.outbox.pg import token
from hybridq.outbox.relay import Relay
from hybridq.outbox.schema import connect, create_table, dialect_of
from hybridq.transport.redisurl import redact_url as redact

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


# --- the relay on PostgreSQL -------------------------------------------------------------------


def journal_ids(journal: Path) -> list[str]:
    if not journal.exists():
        return []
    return [Envelope.from_bytes(r.payload).id for r in JournalReader(journal).records()]


def enqueue_many(dsn: str, n: int, start: int = 0) -> list[str]:
    with psycopg.connect(dsn) as conn, conn.transaction():
        return [Outbox().enqueue(conn, TASK, i, 0) for i in range(start, start + n)]


def opened(dsn: str, journal: Path, **kw: Any) -> Relay:
    relay = Relay(dsn, str(journal), **kw)
    relay.open()
    return relay


def test_the_relay_moves_committed_rows_in_batches_in_order_and_deletes_them(
    pg: str, journal_dir: Path
) -> None:
    ids = enqueue_many(pg, 1203)
    with psycopg.connect(pg) as conn:
        Outbox().enqueue(conn, TASK, "rolled back")
        conn.rollback()
    relay = opened(pg, journal_dir, batch_size=500)
    try:
        assert relay.backlog() == 1203
        assert [relay.step(), relay.step(), relay.step(), relay.step()] == [500, 500, 203, 0]
        assert relay.backlog() == 0
    finally:
        relay.close()
    assert journal_ids(journal_dir) == ids
    assert pg_rows(pg) == []
    assert (relay.relayed, relay.skipped_present) == (1203, 0)


def test_rows_a_killed_relay_appended_are_deleted_not_appended_again(pg: str, journal_dir: Path) -> None:
    ids = enqueue_many(pg, 6)
    mine = token(str(journal_dir), "hybridq_outbox", 0)  # the place a relay on this journal takes first
    # What a relay killed after its append leaves: rows 0-3 marked and in the journal, row 4
    # marked but not appended (killed before the append), row 5 not marked yet.
    with psycopg.connect(pg) as conn:
        conn.execute("UPDATE hybridq_outbox SET relaying = %s WHERE job_id = ANY(%s)", (mine, ids[:5]))
        payloads = [bytes(p) for (p,) in conn.execute("SELECT envelope FROM hybridq_outbox ORDER BY id")]
    with JournalWriter(str(journal_dir)) as writer:
        writer.append_many(payloads[:4])
    relay = opened(pg, journal_dir)
    try:
        assert relay.store.token == mine  # type: ignore[attr-defined]
        relay.run_once()
    finally:
        relay.close()
    assert sorted(journal_ids(journal_dir)) == sorted(ids)  # each once
    assert pg_rows(pg) == []
    assert (relay.relayed, relay.skipped_present) == (6, 4)


def test_two_relays_at_once_take_disjoint_rows(
    pg: str, tmp_path: Path, figures: Callable[[str], None]
) -> None:
    ids = enqueue_many(pg, 3000)
    journals = [tmp_path / "j1", tmp_path / "j1", tmp_path / "j2"]  # two on one journal, one on another
    relays = [opened(pg, journal, batch_size=40) for journal in journals]
    assert len({relay.store.token for relay in relays}) == 3  # type: ignore[attr-defined]
    threads = [threading.Thread(target=relay.run_once) for relay in relays]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for relay in relays:
        relay.close()
    got = journal_ids(tmp_path / "j1") + journal_ids(tmp_path / "j2")
    dup = sum(n - 1 for n in collections.Counter(got).values())
    lost = len(set(ids) - set(got))
    figures(f"outbox pg three-relays rows=3000 per-relay={[r.relayed for r in relays]} lost={lost} dup={dup}")
    assert (lost, dup, len(got)) == (0, 0, 3000)
    assert pg_rows(pg) == []


def test_relays_on_one_journal_take_slots_until_none_is_left(
    pg: str, journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pg_module, "SLOTS", 2)
    first, second = opened(pg, journal_dir), opened(pg, journal_dir)
    try:
        with pytest.raises(JournalLocked, match="2 relays of table hybridq_outbox on this journal already"):
            opened(pg, journal_dir)
    finally:
        first.close()
    third = opened(pg, journal_dir)  # the slot first held is free again
    second.close()
    third.close()


def _housekeeping_until(relay: Any, journal: Path, count: int) -> None:
    """Housekeeping and a relay pass, until ``count`` jobs are in ``journal`` (or 10 s).

    A closed connection's advisory lock is free only once PostgreSQL has ended its session,
    a moment after the client closed it: until then the rows' relay still looks alive, and the
    production relay's periodic housekeeping takes them over on a later pass, as this does.
    """
    deadline = time.monotonic() + 10.0
    while True:
        relay.store.housekeeping()
        relay.run_once()
        if len(journal_ids(journal)) >= count or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def test_a_sibling_relays_marked_rows_are_taken_over_when_it_is_gone(pg: str, journal_dir: Path) -> None:
    ids = enqueue_many(pg, 5)
    first, second = opened(pg, journal_dir, batch_size=3), opened(pg, journal_dir)
    first.store.claim(3)  # marked by the first, which then dies before its append
    first.store.close()
    _housekeeping_until(second, journal_dir, len(ids))
    second.close()
    first.close()
    assert sorted(journal_ids(journal_dir)) == sorted(ids)


def test_another_journals_relays_rows_are_taken_over_only_after_a_grace(
    pg: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = enqueue_many(pg, 4)
    gone = opened(pg, tmp_path / "gone", batch_size=2)
    gone.store.claim(2)
    gone.close()
    relay = opened(pg, tmp_path / "j")
    try:
        relay.run_once()
        assert len(journal_ids(tmp_path / "j")) == 2  # the marked two wait for their relay
        monkeypatch.setattr(pg_module, "ADOPT_AFTER_S", 0.0)
        _housekeeping_until(relay, tmp_path / "j", len(ids))
    finally:
        relay.close()
    assert sorted(journal_ids(tmp_path / "j")) == sorted(ids)


def test_a_commit_wakes_the_relay_by_notify(
    pg: str, journal_dir: Path, figures: Callable[[str], None]
) -> None:
    relay = opened(pg, journal_dir, poll_s=30.0)  # the fallback poll never fires in this test
    thread = threading.Thread(target=relay.run)
    thread.start()
    latencies = []
    try:
        with psycopg.connect(pg) as conn:
            for n in range(20):
                with conn.transaction():
                    Outbox().enqueue(conn, TASK, n, 0)
                committed = time.perf_counter()
                while relay.relayed <= n:
                    assert time.perf_counter() - committed < 10, "no NOTIFY woke the relay"
                    time.sleep(0.0005)
                latencies.append(time.perf_counter() - committed)
    finally:
        relay.stop()
        thread.join(timeout=10)
        relay.close()
    latencies.sort()
    figures(
        f"outbox pg commit->journal n=20 p50={latencies[10] * 1000:.1f}ms max={latencies[-1] * 1000:.1f}ms "
        "(fallback poll 30 s)"
    )
    assert len(journal_ids(journal_dir)) == 20


def test_postgresql_restarted_under_a_running_relay_loses_and_doubles_nothing(
    make_postgres_server: Callable[[], PostgresServer],
    journal_dir: Path,
    caplog: pytest.LogCaptureFixture,
    figures: Callable[[str], None],
) -> None:
    server = make_postgres_server()
    dsn = server.create_database()
    with psycopg.connect(dsn, autocommit=True) as conn:
        Outbox().create_table(conn)
    caplog.set_level("INFO", logger="hybridq.relay")
    relay = opened(dsn, journal_dir, poll_s=0.05)
    thread = threading.Thread(target=relay.run)
    thread.start()
    ids = []
    try:
        ids += enqueue_many(dsn, 100)
        server.restart(down_s=0.3)
        ids += enqueue_many(dsn, 100, start=100)
        deadline = time.monotonic() + 30
        while relay.relayed < 200 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        relay.stop()
        thread.join(timeout=10)
        relay.close()
    got = journal_ids(journal_dir)
    lost = len(set(ids) - set(got))
    dup = len(got) - len(set(got))
    figures(f"outbox pg restart-under-relay rows=200 reconnects={relay.reconnects} lost={lost} dup={dup}")
    assert (lost, dup) == (0, 0)
    assert relay.reconnects >= 1
    lost_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lost the outbox")]
    assert len(lost_lines) == relay.reconnects
    assert "\n" not in lost_lines[0]


def test_relay_cli_on_postgresql(
    pg: str, journal_dir: Path, tmp_path: Path, postgres_server: PostgresServer
) -> None:
    ids = enqueue_many(pg, 7)
    runner = CliRunner()
    result = runner.invoke(
        cli, ["relay", "--outbox", pg, "--journal", str(journal_dir), "--once", "--batch-size", "3"]
    )
    assert result.exit_code == 0, result.output
    assert journal_ids(journal_dir) == ids
    empty = postgres_server.create_database()
    no_table = runner.invoke(cli, ["relay", "--outbox", empty, "--journal", str(tmp_path / "j"), "--once"])
    assert no_table.exit_code == 2
    assert "no table 'hybridq_outbox'" in no_table.output
    assert not (tmp_path / "j").exists()
    down = runner.invoke(
        cli,
        ["relay", "--outbox", f"postgresql://u:secret@/db?host={tmp_path}", "--journal", str(tmp_path / "j")],
    )
    assert down.exit_code == 1
    assert down.output.count("\n") == 1
    assert "secret" not in down.output


def test_the_relay_inside_the_forwarder_is_woken_by_notify_too(
    pg: str, journal_dir: Path, figures: Callable[[str], None]
) -> None:
    from hybridq.outbox.background import BackgroundRelay

    relay = BackgroundRelay(pg, str(journal_dir), poll_s=30.0)  # the poll never fires in this test
    relay.open()
    relay.start()
    latencies = []
    try:
        with psycopg.connect(pg) as conn:
            for n in range(10):
                with conn.transaction():
                    Outbox().enqueue(conn, TASK, n, 0)
                committed = time.perf_counter()
                while relay.relayed <= n and time.perf_counter() - committed < 5:
                    time.sleep(0.001)
                latencies.append(time.perf_counter() - committed)
    finally:
        relay.stop()
        assert relay.join(timeout=10)
        relay.close()
    latencies.sort()
    figures(
        f"outbox pg forward --outbox commit->journal n=10 p50={latencies[5] * 1000:.1f}ms max={latencies[-1] * 1000:.1f}ms"
    )
    assert len(journal_ids(journal_dir)) == 10
    assert latencies[-1] < 5


def test_status_shows_a_postgresql_outboxs_backlog_and_its_age(pg: str, journal_dir: Path) -> None:
    import json

    from hybridq.journal.paths import ensure_journal_dir

    ensure_journal_dir(journal_dir)
    enqueue_many(pg, 3)
    with psycopg.connect(pg) as conn:
        conn.execute("UPDATE hybridq_outbox SET created_at = created_at - 90")
    result = CliRunner().invoke(cli, ["status", "--json", "--journal", str(journal_dir), "--outbox", pg])
    assert result.exit_code == 0, result.output
    outbox = json.loads(result.output)["outbox"]
    assert outbox["rows"] == 3
    assert 90 <= outbox["oldest_age_s"] < 150


def test_a_backlog_read_gives_up_on_a_locked_table_within_a_scrape(pg: str) -> None:
    """A migration's ACCESS EXCLUSIVE lock costs the backlog read its 2 s statement timeout."""
    from hybridq.outbox.backlog import read_backlog

    with psycopg.connect(pg) as migration:
        migration.execute("LOCK TABLE hybridq_outbox IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        with pytest.raises(psycopg.errors.QueryCanceled):
            read_backlog(pg, "hybridq_outbox")
        assert time.monotonic() - started < 10.0  # the scrape's budget
        migration.rollback()
    assert read_backlog(pg, "hybridq_outbox").rows == 0
