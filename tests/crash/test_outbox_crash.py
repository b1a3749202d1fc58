"""The SQLite outbox under SIGKILL (docs/outbox.md): real processes, counted from the journal.

The application is an order service: each transaction inserts an order *and* enqueues its SMS
through the outbox, the order row naming the job id. The oracle is the application's own
committed state: every committed order has exactly one job in the journal (lost=0), no job
exists without its committed order, and no job id is in the journal twice (dup=0).
"""

from __future__ import annotations

import collections
import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hybridq.envelope.model import Envelope
from hybridq.journal import JournalReader
from hybridq.outbox import Outbox

APP = """
import os, signal, sqlite3, sys
from hybridq.outbox import Outbox
conn = sqlite3.connect(sys.argv[1], timeout=30)
outbox = Outbox()
n, kill_at = int(sys.argv[3]), int(sys.argv[2])
while True:
    n += 1
    with conn:
        job = outbox.enqueue(conn, "tests.tasks.add", n, 0, idempotency_key=f"order:{n}:sms")
        conn.execute("INSERT INTO orders (id, job_id) VALUES (?, ?)", (n, job))
    # Committed: the relay has not necessarily seen it (it may never have run yet).
    if n == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    print(job, flush=True)
"""


def make_db(path: Path) -> str:
    with sqlite3.connect(path) as conn:
        Outbox().create_table(conn)
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, job_id TEXT NOT NULL)")
    return f"sqlite:///{path}"


def hybridq(*args: str) -> list[str]:
    return [sys.executable, "-m", "hybridq", *args]


def committed_orders(db: Path) -> list[str]:
    with sqlite3.connect(db) as conn:
        return [job for (job,) in conn.execute("SELECT job_id FROM orders ORDER BY id")]


def outbox_rows(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT count(*) FROM hybridq_outbox").fetchone()[0])


def journal_ids(journal: Path) -> list[str]:
    return [Envelope.from_bytes(r.payload).id for r in JournalReader(journal).records()]


def check(db: Path, journal: Path, env: dict[str, str]) -> tuple[int, int, int]:
    """(jobs, lost, duplicates), asserted through `hybridq status --json` as well."""
    orders, ids = committed_orders(db), journal_ids(journal)
    lost = len(set(orders) - set(ids))
    dup = sum(n - 1 for n in collections.Counter(ids).values())
    assert set(ids) <= set(orders), "a job without its committed order"
    status = subprocess.run(
        hybridq("status", "--json", "--journal", str(journal)),
        env=env,
        capture_output=True,
        check=True,
        timeout=60,
    )
    assert json.loads(status.stdout)["accepted"] == len(ids)
    assert outbox_rows(db) == 0
    return len(ids), lost, dup


def test_a_relay_killed_between_its_append_and_its_delete_loses_nothing_and_makes_no_second_job(
    tmp_path: Path, subprocess_env: dict[str, str], figures: Callable[[str], None]
) -> None:
    db, journal = tmp_path / "app.db", tmp_path / "journal"
    dsn = make_db(db)
    app = subprocess.run(
        [sys.executable, "-c", APP, str(db), "50", "0"],
        env=subprocess_env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert app.returncode == -signal.SIGKILL, app.stderr.decode()[-2000:]
    relay = [
        *hybridq("relay", "--outbox", dsn, "--journal", str(journal)),
        "--batch-size",
        "10",
    ]
    killed = subprocess.run(
        [*relay, "--once"],
        env={**subprocess_env, "HYBRIDQ_CRASH_POINT": "relay_after_append:2"},
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert len(journal_ids(journal)) == 20  # two batches appended ...
    assert outbox_rows(db) == 40  # ... the second one not deleted
    again = subprocess.run(
        [*relay, "--once"], env=subprocess_env, capture_output=True, timeout=60, check=False
    )
    assert again.returncode == 0, again.stderr.decode()[-2000:]
    assert "10 of them are in the journal already" in again.stderr.decode()
    jobs, lost, dup = check(db, journal, subprocess_env)
    figures(f"outbox relay-kill-after-append orders=50 jobs={jobs} lost={lost} dup={dup}")
    assert (jobs, lost, dup) == (50, 0, 0)


def test_an_application_killed_after_its_commit_still_gets_its_jobs(
    tmp_path: Path, subprocess_env: dict[str, str], figures: Callable[[str], None]
) -> None:
    db, journal = tmp_path / "app.db", tmp_path / "journal"
    dsn = make_db(db)
    relay = subprocess.Popen(
        [*hybridq("relay", "--outbox", dsn, "--journal", str(journal)), "--poll", "0.01"],
        env=subprocess_env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for start, kill_at in ((0, 30), (100, 1), (200, 17)):  # SIGKILL right after the Nth commit
            app = subprocess.run(
                [sys.executable, "-c", APP, str(db), str(start + kill_at), str(start)],
                env=subprocess_env,
                capture_output=True,
                timeout=60,
                check=False,
            )
            assert app.returncode == -signal.SIGKILL, app.stderr[-2000:]
        # And one killed at an arbitrary moment by someone else, while the relay runs.
        app = subprocess.Popen(
            [sys.executable, "-c", APP, str(db), "0", "1000"],
            env=subprocess_env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert app.stdout is not None
        for _ in range(25):
            app.stdout.readline()
        app.send_signal(signal.SIGKILL)
        app.wait(timeout=30)
        app.stdout.close()
        deadline = time.monotonic() + 30
        while outbox_rows(db) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        relay.send_signal(signal.SIGTERM)
        _, stderr = relay.communicate(timeout=30)
    assert relay.returncode == 0, stderr[-2000:]
    assert "stopped; relayed" in stderr
    jobs, lost, dup = check(db, journal, subprocess_env)
    figures(
        f"outbox app-kill-after-commit kills=4 orders={len(committed_orders(db))} jobs={jobs} lost={lost} dup={dup}"
    )
    assert jobs >= 30 + 1 + 17 + 25
    assert (lost, dup) == (0, 0)
