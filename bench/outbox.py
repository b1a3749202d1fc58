"""Outbox benchmark: what ``Outbox.enqueue`` costs inside a transaction, and the PostgreSQL relay.

Run it through ``scripts/bench-outbox`` (short by default; ``--n``/``--rows``/``--commits`` for
more). A private PostgreSQL is started for the run (``hybridq.testing.postgres``: a
``postgres`` on PATH or the ``pgserver`` wheel; ``fsync=off``, so the database side is not
bounded by this disk: the journal's fsync is real). Three parts:

1. enqueue cost, SQLite and PostgreSQL: ``outbox.enqueue(conn, f, ...)`` against the bare
   ``INSERT`` it adds (the same statement, the same table and trigger, a row made beforehand),
   side by side in one run, in slices taking turns; per job inside one open transaction, and one
   job per transaction (``BEGIN``, the write, ``COMMIT``); medians over repetitions and the ratio.
2. the relay's throughput on PostgreSQL: rows/s moving a backlog into an fsync'd journal.
3. commit → journal latency on PostgreSQL: one job per commit, the relay woken by ``NOTIFY``
   (fallback poll 30 s), timed until its batch is appended; p50 and p99.
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
from hybridq.outbox import Outbox
from hybridq.outbox.relay import Relay
from hybridq.testing.postgres import PostgresServer, find_bin

FUNC = "tests.tasks.add"
COLUMNS = "(job_id, idempotency_key, queue, envelope, created_at)"


def per_op_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


class Database:
    """One database's way of running the two contestants."""

    def __init__(
        self, name: str, conn: Any, placeholder: str, begin: Callable[[], None], commit: Callable[[], None]
    ):
        self.name, self.conn = name, conn
        marks = ", ".join([placeholder] * 5)
        self.insert = f"INSERT INTO hybridq_outbox {COLUMNS} VALUES ({marks})"
        self.begin, self.commit = begin, commit
        self.outbox = Outbox()
        env = self.outbox.prepare(FUNC, (1, 2), {}, idempotency_key="order:1:sms")
        self.row = (env.id, env.idempotency_key, env.queue, env.to_bytes(), time.time())
        self.counter = 0

    def enqueue(self) -> None:
        self.counter += 1
        self.outbox.enqueue(self.conn, FUNC, self.counter, 2, idempotency_key=f"order:{self.counter}:sms")

    def bare(self) -> None:
        self.conn.execute(self.insert, self.row)

    def clear(self) -> None:
        self.begin()
        self.conn.execute("DELETE FROM hybridq_outbox")
        self.commit()


def sqlite_database(base: Path) -> Database:
    conn = sqlite3.connect(base / "app.db", isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")  # a typical application setting
    Outbox().create_table(conn)
    return Database("sqlite", conn, "?", lambda: conn.execute("BEGIN"), lambda: conn.execute("COMMIT"))


def pg_database(dsn: str) -> Database:
    conn = psycopg.connect(dsn, autocommit=True)
    Outbox().create_table(conn)
    return Database("postgresql", conn, "%s", lambda: conn.execute("BEGIN"), lambda: conn.execute("COMMIT"))


def in_one_transaction(db: Database, op: Callable[[], None], n: int) -> float:
    """Seconds per op, ``n`` ops inside one open transaction (then committed, not timed)."""
    db.begin()
    start = time.perf_counter()
    for _ in range(n):
        op()
    elapsed = time.perf_counter() - start
    db.commit()
    return elapsed / n


def one_per_transaction(db: Database, op: Callable[[], None], n: int) -> float:
    """Seconds per transaction of one op: BEGIN, op, COMMIT."""
    start = time.perf_counter()
    for _ in range(n):
        db.begin()
        op()
        db.commit()
    return (time.perf_counter() - start) / n


def enqueue(db: Database, n: int, repeat: int, slices: int) -> None:
    for mode, measure in (
        ("in one transaction", in_one_transaction),
        ("one job per transaction", one_per_transaction),
    ):
        times: dict[str, list[float]] = {"enqueue": [], "bare": []}
        for rep in range(repeat):
            order = [("enqueue", db.enqueue), ("bare", db.bare)]
            if rep % 2:
                order.reverse()
            totals = dict.fromkeys(times, 0.0)
            for _ in range(slices):  # take turns: a burst of load hits both alike
                for name, op in order:
                    totals[name] += measure(db, op, n // slices)
            for name, samples in times.items():
                samples.append(totals[name] / slices)
            db.clear()
        enqueue_us, bare_us = per_op_us(times["enqueue"]), per_op_us(times["bare"])
        print(
            f"{db.name:<10} {mode:<24} outbox.enqueue {enqueue_us:8.1f} us   bare INSERT {bare_us:8.1f} us"
            f"   ratio {enqueue_us / bare_us:5.2f}x   (+{enqueue_us - bare_us:.1f} us)"
        )


def bench_relay(dsn: str, base: Path, rows: int) -> None:
    with psycopg.connect(dsn) as conn:
        outbox = Outbox()
        for start in range(0, rows, 1000):
            with conn.transaction():
                for i in range(start, min(rows, start + 1000)):
                    outbox.enqueue(conn, FUNC, i, 0)
    journal = base / "relay-journal"
    relay = Relay(dsn, str(journal), batch_size=500)
    relay.open()
    try:
        start = time.perf_counter()
        moved = relay.run_once()
        elapsed = time.perf_counter() - start
    finally:
        relay.close()
    assert moved == rows, (moved, rows)
    print(
        f"postgresql relay: {rows} rows in {elapsed:.2f} s = {rows / elapsed:,.0f} rows/s (batch 500, fsync'd journal)"
    )


def bench_latency(dsn: str, base: Path, commits: int) -> None:
    relay = Relay(dsn, str(base / "latency-journal"), poll_s=30.0)
    relay.open()
    appended = threading.Event()
    store_delete = relay.store.delete

    def delete(ids: list[int]) -> None:  # called right after the batch is in the journal
        appended.set()
        store_delete(ids)

    relay.store.delete = delete  # type: ignore[method-assign]
    thread = threading.Thread(target=relay.run)
    thread.start()
    latencies = []
    try:
        with psycopg.connect(dsn) as conn:
            outbox = Outbox()
            for n in range(commits):
                appended.clear()
                with conn.transaction():
                    outbox.enqueue(conn, FUNC, n, 0)
                committed = time.perf_counter()
                if not appended.wait(10):
                    raise SystemExit("no NOTIFY woke the relay in 10 s")
                latencies.append(time.perf_counter() - committed)
                time.sleep(0.002)  # let the relay finish its delete and wait again
    finally:
        relay.stop()
        thread.join()
        relay.close()
    latencies.sort()
    p50 = latencies[len(latencies) // 2] * 1000
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000
    print(
        f"postgresql commit -> journal: n={commits} p50 {p50:.2f} ms  p99 {p99:.2f} ms  max {latencies[-1] * 1000:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="scripts/bench-outbox", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--n", type=int, default=2000, help="jobs per contestant and repetition (enqueue cost)"
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--slices", type=int, default=10)
    parser.add_argument("--rows", type=int, default=20_000, help="backlog the relay moves")
    parser.add_argument("--commits", type=int, default=200, help="commits timed to the journal")
    parser.add_argument("--dir", default=None, help="where the SQLite database and the journals go")
    args = parser.parse_args()
    bindir = find_bin()
    if bindir is None:
        raise SystemExit("no PostgreSQL: install the postgres extra (pip install -e '.[postgres]')")
    server = PostgresServer(bindir)
    base = Path(tempfile.mkdtemp(prefix="bench-outbox-", dir=args.dir))
    try:
        server.start()
        print(f"{server.version} (fsync=off), python {sys.version.split()[0]}, journal under {base}")
        enqueue(sqlite_database(base), args.n, args.repeat, args.slices)
        enqueue(pg_database(server.create_database()), args.n, args.repeat, args.slices)
        dsn = server.create_database()
        with psycopg.connect(dsn, autocommit=True) as conn:
            Outbox().create_table(conn)
        bench_relay(dsn, base, args.rows)
        bench_latency(dsn, base, args.commits)
    finally:
        server.destroy()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
