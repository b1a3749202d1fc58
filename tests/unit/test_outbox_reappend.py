"""An outbox row relayed twice (a failed delete, a crash) is one job, even once compacted."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import hybridq.outbox.store as store_mod
import pytest
from hybridq.journal import JournalReader, RecordType
from hybridq.outbox import DEFAULT_KEY_PREFIX, Outbox
from hybridq.outbox.background import BackgroundRelay
from hybridq.transport import MemoryTransport

from tests.unit.test_completions import make_forwarder, settle


def _wait(pred: Callable[[], object], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end
        time.sleep(0.02)


def test_a_row_appended_again_after_its_first_record_was_compacted_is_not_a_second_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relay whose delete failed appends its marked rows again once their records are compacted.

    The relay is closed (its segment sealed) and reopened after a failed delete; the forwarder
    compacts that segment once its jobs finished; the reopened relay no longer finds the job ids
    in the journal and appends the rows again. The job ran twice (after a Redis wipe, found in
    review); an outbox job's default key ("outbox:<job id>") is remembered past the compaction.
    """
    journal = tmp_path / "journal"
    db = tmp_path / "app.db"
    conn = sqlite3.connect(db)
    Outbox().create_table(conn)
    job_id = Outbox().enqueue(conn, "tests.tasks.add", 1, 2)  # no key given
    conn.commit()
    conn.close()

    deletes_fail = True
    real = store_mod._in_transaction

    def flaky(
        conn: sqlite3.Connection, sql: str, params: list[tuple[int]]
    ) -> None:  # the app holds a write lock past the 30 s busy timeout
        if deletes_fail and sql.startswith("DELETE"):
            raise sqlite3.OperationalError("database is locked")
        return real(conn, sql, params)

    monkeypatch.setattr(store_mod, "_in_transaction", flaky)
    transport = MemoryTransport()
    forwarder = make_forwarder(journal, transport)
    relay = BackgroundRelay(f"sqlite:///{db}", str(journal), poll_s=0.01, backoff_s=(0.3, 0.3))
    relay.open()
    relay.start()
    try:
        _wait(lambda: relay.failures >= 1)  # appended, marked, not deleted; segment sealed
        for _ in range(3):
            settle(forwarder)
            transport.work()
            settle(forwarder)
            forwarder.completions.hurry()
            forwarder.step()  # compaction: every job of the segment is done
        executions_before = transport.executions.get(job_id, 0)
        transport.forget()  # and Redis is wiped (FLUSHALL) meanwhile
        deletes_fail = False
        _wait(lambda: relay.relayed >= 1)
        for _ in range(3):
            settle(forwarder)
            transport.work()
            settle(forwarder)
    finally:
        relay.stop()
        relay.join(5)
        relay.close()
        forwarder.close()
    records = [
        r
        for r in JournalReader(str(journal)).records()
        if r.rtype == RecordType.DATA and job_id.encode() in r.payload
    ]
    assert len(records) == 1  # the second record (the first one was compacted)
    assert (executions_before, transport.executions.get(job_id, 0)) == (1, 1)


def test_an_outbox_job_without_a_key_gets_one_of_its_job_id(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "app.db")
    outbox = Outbox()
    outbox.create_table(conn)
    job_id = outbox.enqueue(conn, "tests.tasks.add", 1, 2)
    mine = outbox.enqueue(conn, "tests.tasks.add", 1, 2, job_id="order-7")
    keyed = outbox.enqueue(conn, "tests.tasks.add", 1, 2, idempotency_key="sms:7")
    conn.commit()
    keys = dict(conn.execute("SELECT job_id, idempotency_key FROM hybridq_outbox").fetchall())
    assert keys == {job_id: DEFAULT_KEY_PREFIX + job_id, "order-7": "outbox:order-7", keyed: "sms:7"}
    assert mine == "order-7"
