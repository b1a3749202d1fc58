"""A refill after Redis lost its state reads the window's records, not the backlog's (issue 29).

The jobs waiting in the run table were never pushed: Redis cannot have lost them. A refill that
streamed the whole live journal to find the pushed ones cost O(backlog) before the first job
ran again; it now reads the forwarder's durable list of what it pushed (docs/forwarder.md, "The
window").
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hybridq import Queue
from hybridq.forwarder import Forwarder
from hybridq.forwarder.runs import RunTable
from hybridq.journal.reader import list_chains
from hybridq.journal.records import Record
from hybridq.lookup.stats import load_snapshot
from hybridq.testing.memory import MemoryTransport
from hybridq.transport.base import Delivery, PushResult

from tests import tasks

WINDOW = 500
BACKLOG = 10_000


class LengthsTransport(MemoryTransport):
    """The memory transport, reporting queue lengths (the window is bounded) and counting pushes."""

    def __init__(self) -> None:
        super().__init__()
        self.pushes: list[str] = []

    def queue_lengths(self, queues: list[str]) -> dict[str, int]:  # type: ignore[override]
        return {q: len(self.queues.get(q, [])) for q in queues}

    def push(self, jobs: list[Delivery]) -> PushResult:  # type: ignore[override]
        self.pushes += [d.envelope.id for d in jobs]
        return super().push(jobs)


def enqueue(journal: Path, n: int) -> list[str]:
    q = Queue(journal=journal)
    return [j.id for j in q.enqueue_many(q.prepare(tasks.add, [i, i]) for i in range(n))]


def windowed(journal: Path, transport: MemoryTransport, window: int, **options: object) -> Forwarder:
    """An open forwarder whose window is ``window`` jobs per queue."""
    f = Forwarder(journal, transport, window_min=window, window_max=window, **options)  # type: ignore[arg-type]
    f.open()
    return f


def index_all(f: Forwarder, transport: MemoryTransport, n: int) -> None:
    """Step until all ``n`` jobs are in Redis or waiting in the run table (a budget per step)."""
    while f.state.runs.waiting("default") + len(transport.queues.get("default", [])) < n:
        f.step()


@contextmanager
def journal_reads(journal: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Count the journal's records read back (by any reader) inside the block."""
    chains = set(list_chains(str(journal)))
    seen = [0]
    original = Record.__new__

    def counting(cls, writer_id, *rest):  # type: ignore[no-untyped-def]
        if writer_id in chains:
            seen[0] += 1
        return original(cls, writer_id, *rest)

    monkeypatch.setattr(Record, "__new__", counting)
    try:
        yield seen
    finally:
        monkeypatch.undo()


def test_a_refill_after_a_flushall_reads_the_window_not_the_backlog(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = enqueue(journal_dir, BACKLOG)
    transport = LengthsTransport()
    f = windowed(journal_dir, transport, WINDOW)
    try:
        index_all(f, transport, BACKLOG)
        assert len(transport.queues["default"]) == WINDOW
        transport.work("default", limit=WINDOW // 5)  # some ran: their outcomes are harvested
        f.step()
        in_redis = set(transport.queues["default"])
        transport.forget()  # FLUSHALL: the queue, the results, the epoch: all gone
        with journal_reads(journal_dir, monkeypatch) as read:
            f.maintenance.next_epoch_check = 0.0
            f.step()
            while f.completions.reconciler.refilling:
                f.step()
            assert in_redis <= set(transport.queues["default"])  # the window is back
        assert read[0] <= 2 * WINDOW, f"the refill read {read[0]} journal records for a {WINDOW}-job window"
        for _ in range(BACKLOG // (WINDOW // 2) + 20):
            transport.work("default")
            f.step()
        assert transport.executions == dict.fromkeys(ids, 1)
        assert f.state.runs.total == 0
    finally:
        f.close()


def refill_after_flushall(f: Forwarder, transport: MemoryTransport) -> None:
    transport.forget()
    f.maintenance.next_epoch_check = 0.0
    f.step()
    while f.completions.reconciler.refilling:
        f.step()


def test_jobs_pushed_as_read_before_a_crash_are_listed_again_at_start(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pushed as read: their rows wait a second in memory. A crash before they are written must
    # not make a later FLUSHALL lose them: the start reads the records after the mark again.
    ids = enqueue(journal_dir, 50)
    transport = LengthsTransport()
    f = windowed(journal_dir, transport, 100)
    monkeypatch.setattr(f.state.pushed, "flush", lambda positions: None)  # the crash: never written
    f.step()
    assert len(transport.queues["default"]) == 50
    f.close()
    f = windowed(journal_dir, transport, 100)
    try:
        assert f.state.pushed.count() == 50
        refill_after_flushall(f, transport)
        assert sorted(transport.queues["default"]) == sorted(ids)
        transport.work("default")
        f.step()
        assert transport.executions == dict.fromkeys(ids, 1)
    finally:
        f.close()


def test_a_run_table_without_the_list_is_rebuilt_not_trusted_as_empty(journal_dir: Path) -> None:
    # A file written by an older version (or new, or damaged and moved aside) has no list of
    # pushed jobs: it is rebuilt from the journal and the ledger before anything trusts it.
    ids = enqueue(journal_dir, 300)
    transport = LengthsTransport()
    f = windowed(journal_dir, transport, 100)
    f.step()
    transport.work("default", limit=40)
    f.step()
    f.close()
    db = sqlite3.connect(RunTable(str(journal_dir)).path)
    with db:
        db.execute("DROP TABLE pushed")
        db.execute("DELETE FROM meta WHERE name = 'pushed_mark'")
    db.close()
    f = windowed(journal_dir, transport, 100)
    try:
        assert f.state.pushed.count() == len(transport.queues["default"]) == 60
        in_redis = set(transport.queues["default"])
        refill_after_flushall(f, transport)
        assert in_redis <= set(transport.queues["default"])
        for _ in range(20):
            transport.work("default")
            f.step()
        assert transport.executions == dict.fromkeys(ids, 1)
    finally:
        f.close()


def test_an_idle_forwarders_reconcile_reads_the_window_not_the_backlog(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No worker: the window sits in Redis, the backlog in the run table. Each reconcile pass
    # probes the window (a job Redis lost without an epoch change is found only so), and reads
    # nothing of the backlog: an idle forwarder did read 20,000 records at every wait.
    enqueue(journal_dir, BACKLOG // 5)
    transport = LengthsTransport()
    f = windowed(journal_dir, transport, 100, lease_s=0.0)
    try:
        while f.state.runs.waiting("default") < BACKLOG // 5 - 100:
            f.step()
        passes = 5
        with journal_reads(journal_dir, monkeypatch) as read:
            for _ in range(passes):
                f.completions.hurry()
                f.step()
                while f.completions.reconciler.passing:
                    f.step()
        assert read[0] <= passes * 100, f"{passes} idle passes read {read[0]} journal records"
        assert len(transport.queues["default"]) == 100  # nothing found missing, nothing pushed
    finally:
        f.close()


def test_a_restart_pushes_before_it_reads_what_was_forwarded(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 29: the first push after a restart must not wait for a reading of the whole live
    # journal (the stats' count of the jobs read before; it read every record at open).
    enqueue(journal_dir, 2000)
    transport = LengthsTransport()
    f = windowed(journal_dir, transport, 100)
    while f.state.runs.waiting("default") < 1900:
        f.step()
    f.close()
    before = load_snapshot(str(journal_dir))
    assert before is not None
    transport.forget()  # and Redis lost the window meanwhile
    late = Queue(journal=journal_dir).enqueue(tasks.add, 1, 1)
    at_first: list[int] = []
    with journal_reads(journal_dir, monkeypatch) as read:
        for name in ("push", "refill"):  # the window Redis lost goes back through refill
            method = getattr(transport, name)

            def first(*args: object, _method: Any = method) -> Any:
                at_first.append(read[0])
                return _method(*args)

            monkeypatch.setattr(transport, name, first)
        f = windowed(journal_dir, transport, 100)
        f.maintenance.next_epoch_check = 0.0
        f.step()
    try:
        assert len(transport.queues["default"]) >= 100  # the window is back
        assert at_first[0] <= 300, f"the restart read {at_first[0]} journal records before its first push"
        while not f.state.pending_ready:
            f.step()
        f.close()
        after = load_snapshot(str(journal_dir))
        assert after is not None
        assert (after.consumed, after.queues) == (before.consumed + 1, {"default": 2001})
        assert late.id in transport.jobs or f.state.runs.waiting("default") == 1901
    finally:
        f.close()


def test_the_run_tables_counts_are_kept_in_the_file_and_counted_once_for_an_older_one(tmp_path: Path) -> None:
    # A start read every row to count them (about 3 s at a million, before the first push).
    table = RunTable(str(tmp_path))
    table.open()
    table.add((("w", 0, 64 + i), "q" if i % 3 else "r", 1.0 + i, i % 2, "") for i in range(300))
    table.commit()
    table.remove("q", [("w", 0, 64 + i) for i in range(1, 50, 3)])
    table.commit()
    expected = dict(table.counts), {q: dict(p) for q, p in table.prios.items()}
    table.close()

    def grouped() -> tuple[dict[str, int], dict[str, dict[int, int]]]:
        reopened = RunTable(str(tmp_path))
        reopened.open()
        try:
            return dict(reopened.counts), {q: dict(p) for q, p in reopened.prios.items()}
        finally:
            reopened.close()

    assert grouped() == expected
    db = sqlite3.connect(table.path)
    with pytest.raises(sqlite3.OperationalError, match=r"unknown function: hq_counts_kept\(\)"), db:
        db.execute("DELETE FROM runs WHERE off < 100")  # a version that does not keep the counts
    with pytest.raises(sqlite3.OperationalError, match=r"unknown function: hq_counts_kept\(\)"), db:
        db.execute(
            "INSERT INTO runs (chain, seg, off, queue, ord, prio, lkey, lane) VALUES ('w', 1, 64, 'q', 1.0, 0, '', '')"
        )  # nor add a row
    with db:  # as a version before the counts left it
        db.execute("DROP INDEX counts_kept")
        db.execute("DROP TABLE counts")
        db.execute("DELETE FROM meta WHERE name = 'counts'")
        db.execute("DELETE FROM runs WHERE off < 100")  # changed by it: counted again from the rows
        rows = dict(db.execute("SELECT queue, count(*) FROM runs GROUP BY queue").fetchall())
    db.close()
    assert grouped()[0] == rows
    assert grouped()[0] == rows  # and kept since


def test_a_run_table_guarded_by_triggers_gets_the_guard_index_and_loses_them(tmp_path: Path) -> None:
    # The triggers called hq_counts_kept for every row in and out (about 12k instructions a job,
    # docs/benchmarks.md "The forwarder's writes per job, again"); the index's condition is only
    # prepared, never called, and refuses a connection without the function all the same.
    table = RunTable(str(tmp_path))
    table.open()
    table.add([(("w", 0, 64), "q", 1.0, 0, "")])
    table.commit()
    db = table.db
    with db:  # as the version with the triggers left it
        db.execute("COMMIT")
        db.execute("DROP INDEX counts_kept")
        db.execute("CREATE TRIGGER counts_kept_in BEFORE INSERT ON runs BEGIN SELECT hq_counts_kept(); END")
        db.execute("CREATE TRIGGER counts_kept_out BEFORE DELETE ON runs BEGIN SELECT hq_counts_kept(); END")
    table.close()
    table.open()
    try:
        names = {
            n
            for (n,) in table.db.execute("SELECT name FROM sqlite_master WHERE type IN ('index', 'trigger')")
        }
        assert "counts_kept" in names
        assert not names & {"counts_kept_in", "counts_kept_out"}
        table.add([(("w", 0, 128), "q", 2.0, 0, "")])
        table.remove("q", [("w", 0, 64)])
        table.commit()
        assert table.counts == {"q": 1}
        empty = "SELECT count(*) FROM runs INDEXED BY counts_kept WHERE back < 0 AND hq_counts_kept()"
        assert table.db.execute(empty).fetchone() == (0,)
    finally:
        table.close()
    db = sqlite3.connect(table.path)
    for write in (
        "DELETE FROM runs WHERE off > 0",  # (not a lane's update: it changes no count, nor did the triggers stop it)
        "INSERT INTO runs (chain, seg, off, queue, ord, prio, lkey, lane) VALUES ('w', 1, 64, 'q', 1.0, 0, '', '')",
    ):
        with pytest.raises(sqlite3.OperationalError, match=r"unknown function: hq_counts_kept\(\)"), db:
            db.execute(write)
    db.close()
