"""One bad outbox row never stops the outbox (issue 27, finding 5; docs/outbox.md, "Bad rows").

A row whose envelope the relay cannot append (over the journal's 1 MiB record limit; on SQLite,
whose dynamic typing lets any value into the BLOB column, a TEXT, INTEGER or REAL one) failed
its whole batch at every pass: ``hybridq relay`` exited 1 and ``forward --outbox`` relayed 0,
for good. An INTEGER envelope was even taken for a length: ``bytes(2**31)`` allocates 2 GiB. A
bad row is now set aside (``relaying = -1``), counted, shown by ``status`` and ``doctor``, and
the rows after it flow. Its envelope is never read into memory.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
import tracemalloc
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner
from hybridq import Queue
from hybridq.cli import EXIT_FINDINGS, cli
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import MAX_PAYLOAD_BYTES
from hybridq.journal.paths import ensure_journal_dir
from hybridq.outbox import Outbox
from hybridq.outbox import pg as pg_module
from hybridq.outbox.background import BackgroundRelay
from hybridq.outbox.backlog import read_backlog
from hybridq.outbox.relay import Relay
from hybridq.outbox.schema import SET_ASIDE
from hybridq.testing.embedded import RedisServer
from hybridq.transport.rq import RQTransport

from tests.unit.test_outbox import TASK, db, dsn, journal_jobs  # noqa: F401 - the fixture
from tests.unit.test_outbox_pg import enqueue_many, journal_ids, opened, pg  # noqa: F401 - the fixture

#: Each bad envelope SQLite lets in, and the start of what the relay says of it.
BAD = {
    "too-large": (b"x" * (MAX_PAYLOAD_BYTES + 1), f"envelope is {MAX_PAYLOAD_BYTES + 1} bytes"),
    "text": ('{"v": 1, "id": "x"}', "envelope is text"),
    "integer": (2**40, "envelope is integer"),  # bytes(2**40): a MemoryError, at every pass
    "real": (1.5, "envelope is real"),
}


def with_a_bad_row(path: Path, envelope: object) -> tuple[list[str], str]:
    """A good row, a bad one, a good one; the good rows' job ids and the bad one's."""
    with sqlite3.connect(path) as conn:
        first = Outbox().enqueue(conn, TASK, 1, 0)
        conn.execute(
            "INSERT INTO hybridq_outbox (job_id, idempotency_key, queue, envelope, created_at) "
            "VALUES ('bad-job', 'bad-key', 'default', ?, 0)",
            (envelope,),
        )
        last = Outbox().enqueue(conn, TASK, 3, 0)
    return [first, last], "bad-job"


def marks(path: Path) -> dict[str, int]:
    with sqlite3.connect(path) as conn:
        return dict(conn.execute("SELECT job_id, relaying FROM hybridq_outbox").fetchall())


@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_row_is_set_aside_and_the_rows_after_it_are_relayed(
    db: Path,  # noqa: F811 - the fixture
    journal_dir: Path,
    kind: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    envelope, why = BAD[kind]
    good, bad = with_a_bad_row(db, envelope)
    relay = Relay(dsn(db), str(journal_dir))
    relay.open()
    tracemalloc.start()
    try:
        with caplog.at_level(logging.ERROR, logger="hybridq.relay"):
            assert relay.run_once() == 2
        assert relay.run_once() == 0  # set aside once, not again at each pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        relay.close()
    assert peak < 16 * MAX_PAYLOAD_BYTES  # the bad envelope was never read into memory
    assert [env.id for env in journal_jobs(journal_dir)] == good
    assert marks(db) == {bad: SET_ASIDE}
    assert (relay.relayed, relay.set_aside) == (2, 1)
    [line] = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
    assert f"job {bad}" in line
    assert why in line
    backlog = read_backlog(dsn(db), "hybridq_outbox")
    assert (backlog.rows, backlog.oldest_created_at, backlog.set_aside) == (0, None, 1)


def test_relay_cli_relays_past_a_bad_row_and_exits_0(
    db: Path,  # noqa: F811 - the fixture
    journal_dir: Path,
) -> None:
    good, _ = with_a_bad_row(db, BAD["too-large"][0])
    result = CliRunner().invoke(cli, ["relay", "--outbox", dsn(db), "--journal", str(journal_dir), "--once"])
    assert result.exit_code == 0, result.output
    assert [env.id for env in journal_jobs(journal_dir)] == good


def test_status_counts_the_rows_set_aside(
    db: Path,  # noqa: F811 - the fixture
    journal_dir: Path,
) -> None:
    with_a_bad_row(db, 2**40)
    relay = Relay(dsn(db), str(journal_dir))
    relay.open()
    relay.run_once()
    relay.close()
    runner = CliRunner()
    args = ["status", "--journal", str(journal_dir), "--outbox", dsn(db)]
    out = json.loads(runner.invoke(cli, [*args, "--json"]).output)
    assert (out["outbox"]["rows"], out["outbox"]["set_aside"]) == (0, 1)
    text = runner.invoke(cli, args).output
    assert "1 set aside" in text


def test_doctor_reports_the_rows_set_aside(
    db: Path,  # noqa: F811 - the fixture
    journal_dir: Path,
    redis_server: RedisServer,
) -> None:
    Queue("default", journal_dir).enqueue(TASK, 1, 1)
    transport = RQTransport(redis_server.url)
    with Forwarder(journal_dir, transport) as forwarder:
        forwarder.step()
    transport.close()
    _, bad = with_a_bad_row(db, "not bytes")
    relay = Relay(dsn(db), str(journal_dir))
    relay.open()
    relay.run_once()
    relay.close()
    args = ["doctor", "--journal", str(journal_dir), "--redis", redis_server.url, "--outbox", dsn(db)]
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == EXIT_FINDINGS, result.output
    report = json.loads(result.stdout)
    assert report["outbox_set_aside"] == 1
    [row] = report["outbox_set_aside_rows"]
    assert (row["job_id"], row["why"]) == (bad, "envelope is text, not bytes (BLOB/bytea)")
    text = CliRunner().invoke(cli, args).output
    assert f"outbox rows set aside: 1: id {row['id']} job {bad}: envelope is text" in text


def test_the_relay_inside_the_forwarder_relays_past_a_bad_row(
    db: Path,  # noqa: F811 - the fixture
    journal_dir: Path,
) -> None:
    good, _ = with_a_bad_row(db, 2**40)
    ensure_journal_dir(journal_dir)
    relay = BackgroundRelay(dsn(db), str(journal_dir), poll_s=0.01)
    relay.open()
    relay.start()
    try:
        deadline = time.monotonic() + 10
        while relay.relayed < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        relay.stop()
        assert relay.join(timeout=10)
        relay.close()
    assert (relay.relayed, relay.failures) == (2, 0)  # relayed=0 and a failure per pass before
    assert [env.id for env in journal_jobs(journal_dir)] == good
    assert relay.backlog().set_aside == 1


def test_postgresql_a_row_over_the_limit_is_set_aside_and_the_rest_flow(
    pg: str,  # noqa: F811 - the fixture
    journal_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    good = enqueue_many(pg, 1)
    with psycopg.connect(pg) as conn:
        conn.execute(
            "INSERT INTO hybridq_outbox (job_id, idempotency_key, queue, envelope, created_at) "
            "VALUES ('bad-job', 'bad-key', 'default', %s, 0)",
            (b"x" * (MAX_PAYLOAD_BYTES + 1),),
        )
    good += enqueue_many(pg, 1, start=1)
    relay = opened(pg, journal_dir)
    try:
        assert relay.run_once() == 2
        assert relay.run_once() == 0
        assert relay.backlog() == 0
        monkeypatch.setattr(pg_module, "ADOPT_AFTER_S", 0.0)
        relay.store.housekeeping()  # -1 is no relay's token: never taken over
    finally:
        relay.close()
    assert journal_ids(journal_dir) == good
    with psycopg.connect(pg) as conn:
        assert conn.execute("SELECT job_id, relaying FROM hybridq_outbox").fetchall() == [
            ("bad-job", SET_ASIDE)
        ]
    backlog = read_backlog(pg, "hybridq_outbox")
    assert (backlog.rows, backlog.set_aside) == (0, 1)
