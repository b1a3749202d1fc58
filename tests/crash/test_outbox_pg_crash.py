"""The PostgreSQL outbox under SIGKILL and restarts (docs/outbox.md): real processes, real server.

The mirror of test_outbox_crash.py. The application is an order service: each transaction
inserts an order *and* enqueues its SMS through the outbox (psycopg 3), the order row naming the
job id. The oracle is the application's committed state: every committed order has exactly one
job in the journal (lost=0), no job exists without its order, no job id is in the journal twice
(dup=0), and the outbox ends empty.
"""

from __future__ import annotations

import collections
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from hybridq.envelope.model import Envelope
from hybridq.journal import JournalReader
from hybridq.outbox import Outbox

from tests.support.postgres import PostgresServer

APP = """
import os, signal, sys
import psycopg
from hybridq.outbox import Outbox
conn = psycopg.connect(sys.argv[1])
outbox = Outbox()
kill_at, n, last = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
while n < last:
    n += 1
    with conn.transaction():
        job = outbox.enqueue(conn, "tests.tasks.add", n, 0, idempotency_key=f"order:{n}:sms")
        conn.execute("INSERT INTO orders (id, job_id) VALUES (%s, %s)", (n, job))
    # Committed: the relay has not necessarily seen it (it may never have run yet).
    if n == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    print(job, flush=True)
"""


def make_db(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        Outbox().create_table(conn)
        conn.execute("CREATE TABLE orders (id integer PRIMARY KEY, job_id text NOT NULL)")
    return dsn


def hybridq(*args: str) -> list[str]:
    return [sys.executable, "-m", "hybridq", *args]


def app(dsn: str, env: dict[str, str], *, kill_at: int, start: int, last: int = 10**9) -> int:
    """Run the order service from order ``start + 1``; SIGKILLed right after order ``kill_at``'s commit."""
    done = subprocess.run(
        [sys.executable, "-c", APP, dsn, str(kill_at), str(start), str(last)],
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == (-signal.SIGKILL if kill_at else 0), done.stderr.decode()[-2000:]
    return done.returncode


def committed_orders(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [job for (job,) in conn.execute("SELECT job_id FROM orders ORDER BY id")]


def outbox_rows(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM hybridq_outbox").fetchone()
    assert row is not None
    return int(row[0])


def journal_ids(*journals: Path) -> list[str]:
    return [
        Envelope.from_bytes(r.payload).id
        for journal in journals
        if journal.exists()
        for r in JournalReader(journal).records()
    ]


def wait_empty(dsn: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while outbox_rows(dsn) and time.monotonic() < deadline:
        time.sleep(0.05)


def check(dsn: str, env: dict[str, str], *journals: Path) -> tuple[int, int, int]:
    """(jobs, lost, duplicates); each journal's `hybridq status --json` agrees."""
    orders, ids = committed_orders(dsn), journal_ids(*journals)
    lost = len(set(orders) - set(ids))
    dup = sum(n - 1 for n in collections.Counter(ids).values())
    assert set(ids) <= set(orders), "a job without its committed order"
    accepted = 0
    for journal in journals:
        status = subprocess.run(
            hybridq("status", "--json", "--journal", str(journal)),
            env=env,
            capture_output=True,
            check=True,
            timeout=60,
        )
        accepted += json.loads(status.stdout)["accepted"]
    assert accepted == len(ids)
    assert outbox_rows(dsn) == 0
    return len(ids), lost, dup


def stop(relay: subprocess.Popen[str]) -> str:
    relay.send_signal(signal.SIGTERM)
    _, stderr = relay.communicate(timeout=60)
    assert relay.returncode == 0, stderr[-3000:]
    assert "stopped; relayed" in stderr
    return stderr


def test_a_relay_killed_between_its_append_and_its_delete_loses_nothing_and_makes_no_second_job(
    pg_dsn: str, tmp_path: Path, subprocess_env: dict[str, str], figures: Callable[[str], None]
) -> None:
    dsn, journal = make_db(pg_dsn), tmp_path / "journal"
    app(dsn, subprocess_env, kill_at=50, start=0)
    relay = [*hybridq("relay", "--outbox", dsn, "--journal", str(journal)), "--batch-size", "10", "--once"]
    killed = subprocess.run(
        relay,
        env={**subprocess_env, "HYBRIDQ_CRASH_POINT": "relay_after_append:2"},
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert len(journal_ids(journal)) == 20  # two batches appended ...
    assert outbox_rows(dsn) == 40  # ... the second one not deleted
    again = subprocess.run(relay, env=subprocess_env, capture_output=True, timeout=60, check=False)
    assert again.returncode == 0, again.stderr.decode()[-2000:]
    jobs, lost, dup = check(dsn, subprocess_env, journal)
    figures(f"outbox pg relay-kill-after-append orders=50 jobs={jobs} lost={lost} dup={dup}")
    assert "10 of them are in the journal already" in again.stderr.decode()
    assert (jobs, lost, dup) == (50, 0, 0)


def test_an_application_killed_after_its_commit_still_gets_its_jobs(
    pg_dsn: str, tmp_path: Path, subprocess_env: dict[str, str], figures: Callable[[str], None]
) -> None:
    dsn, journal = make_db(pg_dsn), tmp_path / "journal"
    relay = subprocess.Popen(
        hybridq("relay", "--outbox", dsn, "--journal", str(journal)),
        env=subprocess_env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for start, kill_at in ((0, 30), (100, 1), (200, 17)):  # SIGKILL right after the Nth commit
            app(dsn, subprocess_env, kill_at=start + kill_at, start=start)
        # And one killed at an arbitrary moment by someone else, while the relay runs.
        running = subprocess.Popen(
            [sys.executable, "-c", APP, dsn, "0", "1000", str(10**9)],
            env=subprocess_env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert running.stdout is not None
        for _ in range(25):
            running.stdout.readline()
        running.send_signal(signal.SIGKILL)
        running.wait(timeout=30)
        running.stdout.close()
        wait_empty(dsn)
    finally:
        stop(relay)
    jobs, lost, dup = check(dsn, subprocess_env, journal)
    figures(
        f"outbox pg app-kill-after-commit kills=4 orders={len(committed_orders(dsn))} jobs={jobs} lost={lost} dup={dup}"
    )
    assert jobs >= 30 + 1 + 17 + 25
    assert (lost, dup) == (0, 0)


@pytest.mark.parametrize("relays", [1, 2])
def test_postgresql_restarted_mid_relay_loses_and_doubles_nothing(
    make_postgres_server: Callable[[], PostgresServer],
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
    relays: int,
) -> None:
    server = make_postgres_server()
    dsn, journal = make_db(server.create_database()), tmp_path / "journal"
    # 8,000 orders (20,000 cost 15-16 s of CI's run for each count of relays): the first restart
    # after 1,500 are relayed, the second with 3,500 still to relay; a relay that finished first
    # fails below ("nothing tested").
    app(dsn, subprocess_env, kill_at=0, start=0, last=8_000)
    command = [
        *hybridq("relay", "--outbox", dsn, "--journal", str(journal)),
        "--batch-size",
        "100",
        "--poll",
        "0.2",
    ]
    # Several on one journal: each takes its own slot back after the restart.
    running = [
        subprocess.Popen(command, env=subprocess_env, stderr=subprocess.PIPE, text=True)
        for _ in range(relays)
    ]
    restarts = 0
    try:
        for relay in running:  # each one is running (a relay that cannot connect at start exits 1)
            assert relay.stderr is not None
            assert "relaying " in relay.stderr.readline()
        for below in (6_500, 3_500):  # restart twice, while rows are being relayed
            deadline = time.monotonic() + 60
            while outbox_rows(dsn) > below and time.monotonic() < deadline:
                time.sleep(0.005)
            left = outbox_rows(dsn)
            assert left > 0, "the relay finished before the restart: nothing tested"
            server.restart(down_s=0.5)
            restarts += 1
            # Rows only leave: some left now were left at the restart (a relay that finished
            # between the check above and the restart would otherwise pass unnoticed).
            assert outbox_rows(dsn) > 0, "the relay finished before the restart: nothing tested"
        app(dsn, subprocess_env, kill_at=0, start=8_000, last=8_100)  # and rows after the restarts
        wait_empty(dsn)
    finally:
        stderrs = [stop(relay) for relay in running]
    jobs, lost, dup = check(dsn, subprocess_env, journal)
    figures(
        f"outbox pg restart-mid-relay relays={relays} restarts={restarts} orders=8100 jobs={jobs} lost={lost} dup={dup}"
    )
    assert (jobs, lost, dup) == (8_100, 0, 0)
    for stderr in stderrs:  # one line per restart, and back
        lost_lines = [line for line in stderr.splitlines() if "lost the outbox database" in line]
        assert len(lost_lines) == restarts, stderr[-3000:]
        assert stderr.count("reconnected to the outbox after") == restarts


@pytest.mark.parametrize("journals", ["one journal", "two journals"])
def test_two_relays_on_one_outbox_one_killed_between_append_and_delete(
    pg_dsn: str, tmp_path: Path, subprocess_env: dict[str, str], figures: Callable[[str], None], journals: str
) -> None:
    dsn = make_db(pg_dsn)
    first = tmp_path / "journal"
    second = first if journals == "one journal" else tmp_path / "journal-2"

    def relay(journal: Path, **env: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*hybridq("relay", "--outbox", dsn, "--journal", str(journal)), "--batch-size", "20"],
            env={**subprocess_env, **env},
            stderr=subprocess.PIPE,
            text=True,
        )

    steady = relay(first)
    doomed = relay(second, HYBRIDQ_CRASH_POINT="relay_after_append:5")  # SIGKILLs itself mid-way
    producers = [
        subprocess.Popen(
            [sys.executable, "-c", APP, dsn, "0", str(start), str(start + 1500)], env=subprocess_env
        )
        for start in (0, 10_000)
    ]
    try:
        for producer in producers:
            assert producer.wait(timeout=120) == 0
        assert doomed.wait(timeout=60) == -signal.SIGKILL
        assert doomed.stderr is not None
        doomed.stderr.close()
        restarted = relay(second)  # takes its place (and its marked rows) back, or its sibling did
        assert restarted.stderr is not None
        for _ in range(20):  # started (its signal handlers set) once it logs "relaying ..."
            if "relaying " in restarted.stderr.readline():
                break
        wait_empty(dsn)
    finally:
        stderr = stop(steady) + stop(restarted)
    jobs, lost, dup = check(dsn, subprocess_env, *sorted({first, second}))
    figures(f"outbox pg two-relays {journals} relay-killed=1 orders=3000 jobs={jobs} lost={lost} dup={dup}")
    assert "rows were being relayed when a relay stopped" in stderr
    assert (jobs, lost, dup) == (3000, 0, 0)
