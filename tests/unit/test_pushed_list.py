"""The list of pushed jobs under faults: a full disk as a refill starts, a clock stepping back.

Findings of a review of the list (docs/forwarder.md, "The window"): each would leave jobs out
of a refill after Redis lost its state, so that a later loss of their workers strands them.
"""

from __future__ import annotations

import errno
import time
from pathlib import Path

import pytest
from hybridq.errors import JournalIOError
from hybridq.forwarder import delivery as delivery_module
from hybridq.forwarder import pushed as pushed_module
from hybridq.forwarder.runs import RunTable

from tests.unit.test_refill_pushed import (
    LengthsTransport,
    enqueue,
    index_all,
    journal_reads,
    refill_after_flushall,
    windowed,
)


def test_a_full_disk_as_a_refill_starts_does_not_skip_the_refill(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    enqueue(journal_dir, 300)
    transport = LengthsTransport()
    f = windowed(journal_dir, transport, 100)
    try:
        for _ in range(3):
            f.step()
        first = set(transport.queues["default"])
        real = f.state.pushed.flush
        calls = [0]

        def full(positions: object) -> None:
            calls[0] += 1
            if calls[0] == 1:
                raise JournalIOError(
                    "runs.sqlite", "commit", OSError(errno.ENOSPC, "No space left (injected)")
                )
            real(positions)  # type: ignore[arg-type]

        monkeypatch.setattr(f.state.pushed, "flush", full)
        transport.forget()  # FLUSHALL
        f.maintenance.next_epoch_check = 0.0
        with pytest.raises(JournalIOError):
            f.step()  # run() retries the step once the disk has room
        for _ in range(3):
            f.step()
        assert f.completions.reconciler.refilled >= len(first)
        assert first <= set(transport.queues["default"])
    finally:
        f.close()


def test_a_clock_stepping_back_leaves_no_job_out_of_a_refill(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = enqueue(journal_dir, 50)
    transport = LengthsTransport()
    f = windowed(journal_dir, transport, 100)
    try:
        f.step()
        f.state.flush_pushed(force=True)
        wall = time.time
        monkeypatch.setattr(time, "time", lambda: wall() - 3600)  # NTP steps the clock back an hour
        refill_after_flushall(f, transport)
        assert sorted(transport.queues["default"]) == sorted(ids)
    finally:
        f.close()


def test_a_restart_after_only_indexing_reads_about_a_second_of_records(
    journal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The mark moved only with changes to the list: a stretch of only run-table writes (a
    # backlog indexed, nothing pushed) left it behind, and a killed forwarder's next start read
    # every record since (14,900 records at 20,000 jobs indexed with a window of 100).
    enqueue(journal_dir, 3000)
    transport = LengthsTransport()
    monkeypatch.setattr(pushed_module, "FLUSH_EVERY_S", 0.0)  # a second has passed at every step
    monkeypatch.setattr(delivery_module, "INDEX_BUDGET", 500)  # indexed over several steps
    f = windowed(journal_dir, transport, 100)
    index_all(f, transport, 3000)
    f.step()
    f.state.save(0)
    monkeypatch.setattr(f.state.pushed, "flush", lambda positions: None)  # kill -9: nothing more written
    f.close()
    with journal_reads(journal_dir, monkeypatch) as read:
        f = windowed(journal_dir, transport, 100)
    try:
        assert read[0] <= 100, f"the restart read {read[0]} journal records again"
        assert f.state.pushed.count() == 100
    finally:
        f.close()


def test_the_run_tables_sql_runs_on_sqlite_before_3_35(journal_dir: Path) -> None:
    # RHEL 9 ships SQLite 3.34: RETURNING, and an upsert without a conflict target, are syntax
    # errors there (3.35 added both). Every statement of a forwarder's life on the file is traced.
    statements: list[str] = []
    real_connect = RunTable._connect

    def traced(table: RunTable) -> None:
        real_connect(table)
        table.db.set_trace_callback(statements.append)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RunTable, "_connect", traced)
        ids = enqueue(journal_dir, 300)
        transport = LengthsTransport()
        f = windowed(journal_dir, transport, 100)
        try:
            for _ in range(3):
                transport.work("default", limit=50)
                f.step()
            f.state.runs.remove("default", [(f.state.own_chain or "w", 0, 64)])  # each delete's priority
            refill_after_flushall(f, transport)
        finally:
            f.close()
    assert len(ids) == 300
    assert statements
    late = [
        s for s in statements if "RETURNING" in s.upper() or "ON CONFLICT DO" in " ".join(s.upper().split())
    ]
    assert late == []
