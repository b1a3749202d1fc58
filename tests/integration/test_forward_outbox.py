"""``hybridq forward --outbox DSN``: the relay inside the forwarder (docs/outbox.md).

Real processes: an application process commits orders whose jobs go through the SQLite outbox,
the forwarder (with its relay) is a child process on a private Redis, and the jobs are run by a
worker. Runs are counted from an effects file the task appends to (fsync'd), not from hybridq.
"""

from __future__ import annotations

import collections
import signal
import sqlite3
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

from hybridq import Queue
from hybridq.envelope.model import Envelope
from hybridq.journal import JournalReader
from hybridq.outbox import Outbox
from hybridq.rqworker import SimpleWorker
from hybridq.testing.embedded import RedisServer
from prometheus_client.parser import text_string_to_metric_families
from rq import Queue as RQQueue
from rq.serializers import JSONSerializer

from tests.integration.test_metrics import free_port
from tests.support.processes import ForwarderProcess, run_status, wait_until

#: The application: commits orders N+1..N+COUNT, each with its job in the same transaction.
APP = """
import sqlite3, sys
from hybridq.outbox import Outbox
db, effects, start, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
conn = sqlite3.connect(db, timeout=30)
outbox = Outbox()
for n in range(start + 1, start + count + 1):
    with conn:
        job = outbox.enqueue(conn, "tests.tasks.record", effects, f"order:{n}",
                             idempotency_key=f"order:{n}:sms")
        conn.execute("INSERT INTO orders (id, job_id) VALUES (?, ?)", (n, job))
"""


def make_db(path: Path) -> str:
    with sqlite3.connect(path) as conn:
        Outbox().create_table(conn)
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, job_id TEXT NOT NULL)")
    return f"sqlite:///{path}"


def commit_orders(db: Path, effects: Path, start: int, count: int, env: dict[str, str]) -> None:
    """The application process commits ``count`` orders (and their jobs), then exits."""
    done = subprocess.run(
        [sys.executable, "-c", APP, str(db), str(effects), str(start), str(count)],
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def outbox_rows(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT count(*) FROM hybridq_outbox").fetchone()[0])


def journal_ids(journal: Path) -> list[str]:
    return [Envelope.from_bytes(r.payload).id for r in JournalReader(journal).records()]


def run_jobs(redis_server: RedisServer) -> None:
    """Drain the default queue with hybridq's worker, in this process."""
    conn = redis_server.client()
    queue = RQQueue("default", connection=conn, serializer=JSONSerializer)
    SimpleWorker([queue], connection=conn, serializer=JSONSerializer).work(
        burst=True, logging_level="WARNING"
    )


def runs(effects: Path) -> collections.Counter[str]:
    return collections.Counter(effects.read_text().split()) if effects.exists() else collections.Counter()


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_forwarder_relays_committed_rows_into_jobs_that_run_and_stops_both_on_sigterm(
    tmp_path: Path,
    journal_dir: Path,
    redis_server: RedisServer,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    db, effects = tmp_path / "app.db", tmp_path / "effects"
    dsn = make_db(db)
    commit_orders(db, effects, 0, 20, subprocess_env)  # before the forwarder starts
    forwarder = ForwarderProcess(
        journal_dir,
        redis_server.url,
        env=subprocess_env,
        log_path=tmp_path / "forwarder.log",
        extra_args=("--outbox", dsn),
    )
    try:
        commit_orders(db, effects, 20, 20, subprocess_env)  # while it runs
        queued = redis_server.client()
        wait_until(lambda: queued.llen("rq:queue:default") == 40, what="40 jobs in RQ")
        assert outbox_rows(db) == 0
        run_jobs(redis_server)
        wait_until(lambda: run_status(journal_dir, subprocess_env)["succeeded"] == 40, what="40 succeeded")
        forwarder.assert_alive()
    finally:
        rc, took = forwarder.terminate()
    log = forwarder.log()
    assert rc == 0, log[-3000:]
    assert "stopped; relayed 40 jobs" in log
    assert "stopped; checkpoint saved" in log
    counted = runs(effects)
    assert counted == collections.Counter({f"order:{n}": 1 for n in range(1, 41)})
    figures(f"OUTBOX forward --outbox orders=40 ran={sum(counted.values())} stop_s={took:.2f}")


def test_a_forwarder_killed_between_the_relays_append_and_delete_makes_no_second_job(
    tmp_path: Path,
    journal_dir: Path,
    redis_server: RedisServer,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    db, effects = tmp_path / "app.db", tmp_path / "effects"
    dsn = make_db(db)
    commit_orders(db, effects, 0, 30, subprocess_env)
    killed = ForwarderProcess(
        journal_dir,
        redis_server.url,
        env={**subprocess_env, "HYBRIDQ_CRASH_POINT": "relay_after_append:1"},
        log_path=tmp_path / "forwarder.log",
        extra_args=("--outbox", dsn),
    )
    assert killed.wait(60) == -signal.SIGKILL, killed.log()[-3000:]
    assert len(journal_ids(journal_dir)) == 30  # the batch is in the journal ...
    assert outbox_rows(db) == 30  # ... and still in the outbox
    commit_orders(db, effects, 30, 20, subprocess_env)  # the application goes on meanwhile
    forwarder = ForwarderProcess(
        journal_dir,
        redis_server.url,
        env=subprocess_env,
        log_path=tmp_path / "forwarder.log",
        extra_args=("--outbox", dsn),
    )
    try:
        wait_until(lambda: outbox_rows(db) == 0, what="the outbox relayed")
        wait_until(
            lambda: run_status(journal_dir, subprocess_env)["not_yet_forwarded"] == 0, what="forwarded"
        )
        run_jobs(redis_server)
        wait_until(lambda: run_status(journal_dir, subprocess_env)["succeeded"] == 50, what="50 succeeded")
    finally:
        rc, _ = forwarder.terminate()
    assert rc == 0, forwarder.log()[-3000:]
    assert "30 of them are in the journal already" in forwarder.log()
    ids, counted = journal_ids(journal_dir), runs(effects)
    dup_records = len(ids) - len(set(ids))
    lost = 50 - len(counted)
    twice = sum(n - 1 for n in counted.values())
    figures(
        f"OUTBOX forward --outbox killed after append: orders=50 records={len(ids)} "
        f"lost={lost} dup_records={dup_records} ran_twice={twice}"
    )
    assert (len(ids), lost, dup_records, twice) == (50, 0, 0, 0)


def test_status_and_metrics_show_the_backlog_while_the_relay_cannot_relay(
    tmp_path: Path,
    journal_dir: Path,
    redis_server: RedisServer,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    db, effects = tmp_path / "app.db", tmp_path / "effects"
    dsn = make_db(db)
    commit_orders(db, effects, 0, 5, subprocess_env)
    with sqlite3.connect(db) as conn:  # inserted two minutes ago
        conn.execute("UPDATE hybridq_outbox SET created_at = created_at - 120")
    journal_dir.mkdir(mode=0o700)
    # No forwarder yet: status reads the backlog from the database itself.
    before = run_status_outbox(journal_dir, dsn, subprocess_env)
    assert before["rows"] == 5
    assert 120 <= before["oldest_age_s"] < 180
    # Another transaction holds SQLite's write lock: the relay can read, not mark or delete.
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    port = free_port()
    forwarder = ForwarderProcess(
        journal_dir,
        redis_server.url,
        env=subprocess_env,
        log_path=tmp_path / "forwarder.log",
        extra_args=("--outbox", dsn, "--metrics-port", str(port)),
    )
    try:
        stuck = wait_until(lambda: _scrape_or_none(port), what="metrics served")
        assert stuck["hybridq_outbox_rows"] == 5
        assert stuck["hybridq_outbox_oldest_age_seconds"] >= 120
        assert stuck["hybridq_outbox_relayed_total"] == 0
        during = run_status_outbox(journal_dir, dsn, subprocess_env)
        assert during["rows"] == 5
        assert during["oldest_age_s"] >= 120
        blocker.execute("ROLLBACK")  # the lock goes: the relay catches up
        done = wait_until(
            lambda: (m := scrape(port))["hybridq_outbox_relayed_total"] == 5 and m, what="5 relayed"
        )
        forwarder.assert_alive()
    finally:
        blocker.close()
        rc, _ = forwarder.terminate()
    assert rc == 0, forwarder.log()[-3000:]
    assert (done["hybridq_outbox_rows"], done["hybridq_outbox_oldest_age_seconds"]) == (0, 0)
    figures(
        f"OUTBOX backlog while locked: status rows={during['rows']} age_s={during['oldest_age_s']:.0f}; "
        f"metrics rows={stuck['hybridq_outbox_rows']:.0f} age_s={stuck['hybridq_outbox_oldest_age_seconds']:.0f}; "
        f"after the lock: relayed={done['hybridq_outbox_relayed_total']:.0f}"
    )


def test_forwarding_goes_on_while_the_relay_fails(
    tmp_path: Path, journal_dir: Path, redis_server: RedisServer, subprocess_env: dict[str, str]
) -> None:
    db, effects = tmp_path / "app.db", tmp_path / "effects"
    dsn = make_db(db)
    forwarder = ForwarderProcess(
        journal_dir,
        redis_server.url,
        env=subprocess_env,
        log_path=tmp_path / "forwarder.log",
        extra_args=("--outbox", dsn),
    )
    try:
        wait_until(lambda: "relaying" in forwarder.log(), what="the relay started")
        with sqlite3.connect(db) as conn:
            conn.execute("DROP TABLE hybridq_outbox")  # the relay fails from now on
        wait_until(lambda: "outbox relay failed" in forwarder.log(), what="the failure logged")
        Queue("default", journal_dir).enqueue("tests.tasks.record", str(effects), "plain")
        queued = redis_server.client()
        wait_until(lambda: queued.llen("rq:queue:default") == 1, what="a plain job forwarded meanwhile")
        with sqlite3.connect(db) as conn:
            Outbox().create_table(conn)
        commit_orders(db, effects, 0, 1, subprocess_env)
        wait_until(lambda: queued.llen("rq:queue:default") == 2, timeout=40, what="the relay back")
        forwarder.assert_alive()
    finally:
        rc, _ = forwarder.terminate()
    log = forwarder.log()
    assert rc == 0, log[-3000:]
    assert log.count("outbox relay failed") == 1, log[-3000:]
    assert "outbox relay working again after" in log
    run_jobs(redis_server)
    assert runs(effects) == collections.Counter({"plain": 1, "order:1": 1})


def run_status_outbox(journal: Path, dsn: str, env: dict[str, str]) -> dict[str, float]:
    """``hybridq status --json`` with the outbox given by ``HYBRIDQ_OUTBOX``: its ``outbox`` key."""
    out = run_status(journal, {**env, "HYBRIDQ_OUTBOX": dsn})
    box: dict[str, float] = out["outbox"]
    return box


def _scrape_or_none(port: int) -> dict[str, float] | None:
    try:
        return scrape(port)
    except OSError:
        return None  # not listening yet
