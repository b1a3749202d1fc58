"""The SQLite outbox (docs/outbox.md): enqueue in the application's transaction, and the relay."""

from __future__ import annotations

import datetime as dt
import sqlite3
from pathlib import Path

import pytest
from hybridq import EnvelopeError, JournalLocked, NotSerializable, Queue, RecordTooLarge, Retry
from hybridq.envelope.model import Envelope
from hybridq.journal import JournalReader, JournalWriter
from hybridq.outbox import Outbox
from hybridq.outbox.relay import Relay
from hybridq.outbox.schema import connect, sqlite_path

TASK = "tests.tasks.add"


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        Outbox().create_table(conn)
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, state TEXT)")
    return path


def dsn(db: Path) -> str:
    return f"sqlite:///{db}"  # an absolute path: sqlite:////tmp/...


def rows(db: Path) -> list[tuple[str, str, int]]:
    with sqlite3.connect(db) as conn:
        return conn.execute(
            "SELECT job_id, idempotency_key, relaying FROM hybridq_outbox ORDER BY id"
        ).fetchall()


def journal_jobs(journal: Path) -> list[Envelope]:
    if not journal.exists():
        return []
    return [Envelope.from_bytes(r.payload) for r in JournalReader(journal).records()]


def relay_once(db: Path, journal: Path, **kw: int) -> Relay:
    relay = Relay(dsn(db), str(journal), **kw)
    relay.open()
    try:
        relay.run_once()
    finally:
        relay.close()
    return relay


def test_a_committed_row_becomes_the_job_with_the_rows_id_and_key(db: Path, journal_dir: Path) -> None:
    conn = sqlite3.connect(db)
    with conn:  # the application's transaction: its own write and the job commit together
        conn.execute("INSERT INTO orders (state) VALUES ('complete')")
        job_id = Outbox().enqueue(conn, TASK, 1, 2, idempotency_key="order:1:sms", queue="sms", job_timeout=5)
    conn.close()
    assert rows(db) == [(job_id, "order:1:sms", 0)]
    relay = relay_once(db, journal_dir)
    [env] = journal_jobs(journal_dir)
    assert (env.id, env.idempotency_key, env.queue, env.func, env.args, env.timeout_s) == (
        job_id,
        "order:1:sms",
        "sms",
        TASK,
        (1, 2),
        5.0,
    )
    assert rows(db) == []
    assert (relay.relayed, relay.skipped_present) == (1, 0)
    assert Queue(journal=journal_dir).prepare(TASK).queue == "default"


def test_a_rolled_back_transaction_leaves_no_job(db: Path, journal_dir: Path) -> None:
    conn = sqlite3.connect(db)

    def place_order() -> None:
        with conn:
            conn.execute("INSERT INTO orders (state) VALUES ('complete')")
            Outbox().enqueue(conn, TASK, 1, 2)
            raise RuntimeError("the order failed")

    with pytest.raises(RuntimeError):
        place_order()
    conn.close()
    assert rows(db) == []
    relay_once(db, journal_dir)
    assert journal_jobs(journal_dir) == []


@pytest.mark.parametrize(
    ("call", "error"),
    [
        ((lambda: 1,), EnvelopeError),
        (("not a path",), EnvelopeError),
        ((TASK, object()), NotSerializable),
        ((TASK, {1: "a"}), NotSerializable),
        ((TASK, "x" * (1 << 20)), RecordTooLarge),
    ],
)
def test_bad_calls_raise_like_queue_enqueue_and_insert_nothing(
    db: Path, journal_dir: Path, call: tuple[object, ...], error: type[Exception]
) -> None:
    conn = sqlite3.connect(db)
    with pytest.raises(error) as from_outbox:
        Outbox().enqueue(conn, *call)
    with pytest.raises(error) as from_queue:
        Queue(journal=journal_dir).enqueue(*call)
    assert type(from_outbox.value) is type(from_queue.value)
    if error is not RecordTooLarge:  # its message gives the size, which the timestamps vary
        assert str(from_outbox.value) == str(from_queue.value)
    conn.commit()
    conn.close()
    assert rows(db) == []


@pytest.mark.parametrize(
    "options",
    [
        {"queue": "bad queue"},
        {"idempotency_key": ""},
        {"job_timeout": -1},
        {"delay": 1, "run_at": 2},
        {"run_at": dt.datetime(2030, 1, 1)},  # noqa: DTZ001 - naive on purpose
        {"job_id": "no spaces"},
        {"retry": 3},
        {"depends_on": "x"},
        {"meta": {"hybridq": 1}},
    ],
)
def test_bad_options_raise_and_insert_nothing(db: Path, options: dict[str, object]) -> None:
    conn = sqlite3.connect(db)
    with pytest.raises(EnvelopeError):
        Outbox().enqueue(conn, TASK, 1, **options)
    conn.commit()
    conn.close()
    assert rows(db) == []


def test_options_and_the_explicit_args_form_are_those_of_queue_enqueue(db: Path, journal_dir: Path) -> None:
    conn = sqlite3.connect(db)
    with conn:
        outbox = Outbox()
        outbox.enqueue(conn, TASK, args=(1,), kwargs={"b": 2}, retry=Retry(max_attempts=4), delay=60)
        outbox.enqueue(conn, TASK, 3, b=4, job_id="mine-1", description="d", meta={"m": 1})
    conn.close()
    relay_once(db, journal_dir)
    first, second = journal_jobs(journal_dir)
    assert (first.args, first.kwargs, first.max_attempts) == ((1,), {"b": 2}, 4)
    assert first.run_at is not None
    assert first.run_at > first.created_at + 59
    assert (second.id, second.args, second.kwargs, second.description, second.meta) == (
        "mine-1",
        (3,),
        {"b": 4},
        "d",
        {"m": 1},
    )


def test_an_unsupported_connection_is_a_type_error_that_names_what_is_supported() -> None:
    supported = r"supports a sqlite3\.Connection, a psycopg\.Connection \(psycopg 3\), or a SQLAlchemy Connection or Session"
    with pytest.raises(TypeError, match=rf"{supported}, not builtins\.object\Z"):
        Outbox().enqueue(object(), TASK, 1)
    cursor = sqlite3.connect(":memory:").cursor()
    with pytest.raises(TypeError, match=r"not sqlite3\.Cursor\Z"):
        Outbox().enqueue(cursor, TASK, 1)
    cursor.connection.close()


def test_a_table_name_must_be_an_identifier() -> None:
    with pytest.raises(ValueError, match="not a plain identifier"):
        Outbox(table="x; DROP TABLE orders")
    assert "CREATE TABLE IF NOT EXISTS my_outbox" in Outbox(table="my_outbox").ddl()


@pytest.mark.parametrize(
    ("value", "path"), [("sqlite:///app.db", "app.db"), ("sqlite:////var/app.db", "/var/app.db")]
)
def test_sqlite_dsns(value: str, path: str) -> None:
    assert sqlite_path(value) == path


@pytest.mark.parametrize(
    "value", ["", "app.db", "sqlite://app.db", "sqlite:///", "sqlite:///:memory:", "postgresql://u:pw@h/db"]
)
def test_bad_dsns_are_refused(value: str) -> None:
    with pytest.raises(ValueError, match="sqlite:///") as info:
        sqlite_path(value)
    assert "pw" not in str(info.value)


def test_the_relay_moves_rows_in_batches_in_order_and_deletes_them(db: Path, journal_dir: Path) -> None:
    conn = sqlite3.connect(db)
    with conn:
        ids = [Outbox().enqueue(conn, TASK, i, 0) for i in range(1203)]
    conn.close()
    relay = Relay(dsn(db), str(journal_dir), batch_size=500)
    relay.open()
    try:
        assert relay.backlog() == 1203
        assert [relay.step(), relay.step(), relay.step(), relay.step()] == [500, 500, 203, 0]
        assert relay.backlog() == 0
    finally:
        relay.close()
    assert [env.id for env in journal_jobs(journal_dir)] == ids
    assert rows(db) == []


def test_rows_a_killed_relay_appended_are_deleted_not_appended_again(db: Path, journal_dir: Path) -> None:
    conn = sqlite3.connect(db)
    with conn:
        ids = [Outbox().enqueue(conn, TASK, i, 0) for i in range(6)]
    # What a relay killed after its append leaves: rows 0-3 marked and in the journal, row 4
    # marked but not appended (killed before the append), row 5 not marked yet.
    with conn:
        conn.execute("UPDATE hybridq_outbox SET relaying = 1 WHERE job_id IN (?, ?, ?, ?, ?)", ids[:5])
        payloads = [bytes(p) for (p,) in conn.execute("SELECT envelope FROM hybridq_outbox ORDER BY id")]
    conn.close()
    with JournalWriter(str(journal_dir)) as writer:
        writer.append_many(payloads[:4])
    relay = relay_once(db, journal_dir)
    assert sorted(env.id for env in journal_jobs(journal_dir)) == sorted(ids)  # each once
    assert rows(db) == []
    assert (relay.relayed, relay.skipped_present) == (6, 4)


def test_one_relay_per_outbox(db: Path, journal_dir: Path) -> None:
    first = Relay(dsn(db), str(journal_dir))
    first.open()
    try:
        second = Relay(dsn(db), str(journal_dir))
        with pytest.raises(JournalLocked, match="locked by another relay"):
            second.open()
    finally:
        first.close()
    relay_once(db, journal_dir)  # released on close


def test_connect_does_not_create_a_database_unless_asked(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="outbox init"):
        connect(f"sqlite:///{tmp_path}/typo.db")
    assert list(tmp_path.iterdir()) == []


def test_relayed_jobs_are_forwarded_and_run_like_any_other(
    db: Path, journal_dir: Path, tmp_path: Path
) -> None:
    from hybridq.forwarder.loop import Forwarder
    from hybridq.ops.status import collect_status
    from hybridq.transport import MemoryTransport

    from tests.tasks import record

    effects = tmp_path / "effects"
    conn = sqlite3.connect(db)
    with conn:
        for n in range(5):
            Outbox().enqueue(
                conn, "tests.tasks.record", str(effects), f"sms-{n}", idempotency_key=f"order:{n}"
            )
    conn.close()
    relay_once(db, journal_dir)
    transport = MemoryTransport()
    forwarder = Forwarder(journal_dir, transport, reconcile_interval_s=0.0)
    forwarder.open()
    try:
        forwarder.step()
        transport.work(func=lambda env, _attempt: record(*env.args))
        for _ in range(5):
            forwarder.completions.hurry()
            forwarder.step()
    finally:
        forwarder.close()
    assert sorted(effects.read_text().split()) == [f"sms-{n}" for n in range(5)]
    status = collect_status(str(journal_dir))
    assert (status["accepted"], status["succeeded"], status["pending"]) == (5, 5, 0)


def test_with_a_signing_key_the_row_holds_the_signed_envelope(
    db: Path, journal_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from hybridq.outbox.relay import _ID_PREFIX
    from hybridq.security.signing import ENV_KEY_FILE, keyring

    key = tmp_path / "key"
    key.write_text("k" * 40 + "\n", encoding="utf-8")
    os.chmod(key, 0o600)
    monkeypatch.setenv(ENV_KEY_FILE, str(key))
    conn = sqlite3.connect(db)
    with conn:
        job_id = Outbox().enqueue(conn, TASK, 1, 2)
        [(payload,)] = conn.execute("SELECT envelope FROM hybridq_outbox").fetchall()
    conn.close()
    ring = keyring()
    assert ring is not None
    ring.verify(Envelope.from_bytes(payload))  # raises if unsigned or tampered
    match = _ID_PREFIX.match(payload)  # the relay's after-crash lookup reads signed ids too
    assert match is not None
    assert match.group(1).decode() == job_id
    relay_once(db, journal_dir)
    assert [env.signature for env in journal_jobs(journal_dir)] == [Envelope.from_bytes(payload).signature]


def test_a_missing_table_says_how_to_create_it(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "empty.db")
    with pytest.raises(sqlite3.OperationalError, match="no such table: hybridq_outbox: create it with"):
        Outbox().enqueue(conn, TASK, 1, 2)
    conn.close()


def test_the_running_relay_logs_its_progress_and_its_stop(
    db: Path, journal_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import threading
    import time

    from hybridq.outbox import relay as relay_module

    monkeypatch.setattr(relay_module, "PROGRESS_EVERY_S", 0.0)
    caplog.set_level("INFO", logger="hybridq.relay")
    relay = Relay(dsn(db), str(journal_dir), poll_s=0.01)
    relay.open()
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        conn = sqlite3.connect(db)
        with conn:
            Outbox().enqueue(conn, TASK, 1, 2)
        conn.close()
        deadline = time.monotonic() + 10
        while relay.relayed < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        relay.stop()
        thread.join(timeout=10)
        relay.close()
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("relaying ")
    assert any(m.startswith("relayed 1 jobs in the last") and m.endswith("backlog 0") for m in messages)
    assert messages[-1] == "stopped; relayed 1 jobs"
