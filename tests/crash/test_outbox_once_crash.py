"""``outbox.once`` under SIGKILL and FLUSHALL (docs/outbox.md, "Exactly-once effects: once()").

Real processes: the order service commits an order and its SMS job through the outbox,
``hybridq relay --once`` moves it into the journal, ``hybridq forward`` and ``hybridq worker``
(the pool) run it against a private redis-server. The task (``tests.once_tasks.send_sms``)
commits its effect, a row in the application's SQLite database, and on its first run SIGKILLs
its own process before the outcome is stored; the test then wipes Redis (FLUSHALL), so nothing
in Redis says the job ran. The job runs again: with ``outbox.once`` the effect is there once;
without it (the comparison), twice.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hybridq.journal.paths import ensure_journal_dir
from hybridq.outbox import Outbox
from hybridq.outbox.once import create_done_table
from hybridq.testing.embedded import RedisServer

from tests.support.processes import ForwarderProcess, WorkerProcess, run_status, wait_until

LEASE_S = "2"


def make_db(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        Outbox().create_table(conn)
        create_done_table(conn)
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, state TEXT NOT NULL)")
        conn.execute("CREATE TABLE sms (order_id INTEGER NOT NULL)")
        conn.execute("CREATE TABLE runs (order_id INTEGER NOT NULL, pid INTEGER NOT NULL)")
    conn.close()


def count(db: Path, table: str) -> int:
    with sqlite3.connect(db) as conn:
        n = int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
    conn.close()
    return n


def pids(db: Path) -> list[int]:
    with sqlite3.connect(db) as conn:
        out = [pid for (pid,) in conn.execute("SELECT pid FROM runs ORDER BY rowid")]
    conn.close()
    return out


@pytest.fixture
def processes() -> Iterator[list[ForwarderProcess | WorkerProcess]]:
    procs: list[ForwarderProcess | WorkerProcess] = []
    yield procs
    for proc in procs:
        proc.kill()


@pytest.mark.parametrize("use_once", [True, False], ids=["once", "plain"])
def test_an_effect_committed_before_a_sigkill_and_a_flushall_happens_exactly_once_with_once(
    use_once: bool,
    tmp_path: Path,
    journal_dir: Path,
    redis_server: RedisServer,
    subprocess_env: dict[str, str],
    processes: list[ForwarderProcess | WorkerProcess],
    figures: Callable[[str], None],
) -> None:
    db, marker = tmp_path / "app.db", tmp_path / "first-run.pid"
    make_db(db)
    # The order service: the order and its SMS job in one transaction.
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("INSERT INTO orders (id, state) VALUES (42, 'complete')")
        Outbox().enqueue(
            conn, "tests.once_tasks.send_sms", str(db), 42, use_once, str(marker), idempotency_key="sms:42"
        )
    conn.close()
    relay = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridq",
            "relay",
            "--outbox",
            f"sqlite:///{db}",
            "--journal",
            str(journal_dir),
            "--once",
        ],
        env=subprocess_env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert relay.returncode == 0, relay.stderr.decode()[-2000:]

    ensure_journal_dir(journal_dir)
    forwarder = ForwarderProcess(
        journal_dir,
        redis_server.url,
        env=subprocess_env,
        log_path=tmp_path / "forwarder.log",
        extra_args=("--lease", LEASE_S),
    )
    processes.append(forwarder)
    worker = WorkerProcess(
        [sys.executable, "-m", "hybridq", "worker", "--redis", redis_server.url, "default"],
        env=subprocess_env,
        log_path=tmp_path / "worker.log",
        cwd=tmp_path,
    )
    processes.append(worker)

    def first_run_died() -> bool:
        forwarder.assert_alive()
        worker.assert_alive()
        return marker.exists() and count(db, "runs") == 1

    wait_until(first_run_died, timeout=60, what="the first run to commit its effect and die")
    assert count(db, "sms") == 1  # the effect committed before the kill
    redis_server.flushall()  # nothing in Redis remembers the run

    def succeeded() -> bool:
        forwarder.assert_alive()
        worker.assert_alive()
        return run_status(journal_dir, subprocess_env)["succeeded"] == 1

    wait_until(succeeded, timeout=90, interval=0.25, what="the job to run again and succeed")
    runs, effects, done = count(db, "runs"), count(db, "sms"), count(db, "hybridq_done")
    first, again = pids(db)
    assert first == int(marker.read_text()) != again  # the first run's process died; another re-ran it
    mode = "once" if use_once else "plain"
    figures(
        f"outbox once worker-sigkill-after-commit+flushall mode={mode} runs={runs} effects={effects} done_rows={done}"
    )
    assert runs == 2
    if use_once:
        assert (effects, done) == (1, 1)
    else:  # the comparison: the re-run repeats an effect nothing recorded
        assert (effects, done) == (2, 0)
