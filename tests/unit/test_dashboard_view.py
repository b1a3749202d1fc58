"""The dashboard on a big ledger: read incrementally, paginated, one page built at a time (review H2)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import hybridq
import pytest
from hybridq.http.config import ServeConfig
from hybridq.http.dashboard import routes
from hybridq.http.dashboard.failed import PER_PAGE
from hybridq.http.dashboard.ledger_view import LedgerView
from hybridq.http.dashboard.pages import Pages
from hybridq.journal import JournalReader
from hybridq.journal.holes import Hole, punch_holes
from hybridq.ledger.compacted import Compacted, save_compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.store import ledger_dir, open_ledger_writer
from hybridq.protocol import EntryKind
from starlette.applications import Starlette

from tests.support.webserver import request, serving


def _failures(journal: Path, n: int, start: int = 0) -> list[hybridq.Job]:
    queue = hybridq.Queue("q", journal)
    jobs = [queue.enqueue("tests.tasks.add", i, 1) for i in range(start, start + n)]
    with open_ledger_writer(str(journal)) as writer:
        writer.append_many(
            Entry(EntryKind.DONE, j.id, (j.record.writer_id, j.record.segment, j.record.offset),
                  outcome="failed", attempt=1, error=f"E: {i}", at=1000.0 + start + i, worker="h/1",
                  job=j.envelope.to_dict(), queue="q").to_bytes()
            for i, j in enumerate(jobs)
        )  # fmt: skip
    return jobs


def test_the_view_reads_only_what_was_appended(journal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _failures(journal_dir, 3)
    view = LedgerView(str(journal_dir))
    assert [f.id for f in view.failed()] == [j.id for j in first]
    more = _failures(journal_dir, 2, start=3)
    assert [f.id for f in view.failed()] == [j.id for j in first + more]
    assert view.rebuilds == 1
    assert [e.kind for e in view.entries(more[0].id)] == ["done"]
    hybridq.requeue([first[0].id], journal_dir, failed=view.failed)
    assert first[0].id not in [f.id for f in view.failed()]
    assert view.was_requeued(first[0].id)
    assert not view.was_requeued(first[1].id)
    assert view.rebuilds == 1
    save_compacted(str(journal_dir), Compacted(accepted=1))  # a compaction: read everything again
    assert len(view.failed()) == 4
    assert view.rebuilds == 2
    # The trace by id comes from the view: the whole ledger is not scanned per request.
    monkeypatch.setattr("hybridq.ops.trace._ledger_entries", None)
    app = Starlette(routes=routes(ServeConfig(journal=journal_dir)))
    with serving(app) as base:
        page = request(base + f"/jobs/{more[1].id}")
        assert page.status == 200
        assert "E: 1" in page.body


def test_failed_is_paginated_newest_first(journal_dir: Path) -> None:
    jobs = _failures(journal_dir, PER_PAGE + 7)
    app = Starlette(routes=routes(ServeConfig(journal=journal_dir)))
    with serving(app) as base:
        first = request(base + "/failed")
        ids = re.findall(r'name="job_id" value="([0-9a-f]+)"', first.body)
        assert ids == [j.id for j in reversed(jobs)][:PER_PAGE]
        assert 'href="/failed?page=2"' in first.body
        second = request(base + "/failed?page=2")
        ids = re.findall(r'name="job_id" value="([0-9a-f]+)"', second.body)
        assert ids == [j.id for j in reversed(jobs)][PER_PAGE:]
        assert request(base + "/failed?page=99").status == 200
        assert request(base + "/failed?page=x").status == 200


def test_one_page_is_built_at_a_time(journal_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hybridq.http.dashboard.pages.HEAVY_WAIT_S", 0.2)
    _failures(journal_dir, 1)
    app_routes = routes(ServeConfig(journal=journal_dir))
    pages = app_routes[0].endpoint.__self__  # type: ignore[attr-defined]
    assert isinstance(pages, Pages)
    with serving(Starlette(routes=app_routes)) as base:
        assert pages._heavy.acquire(timeout=1)  # a slow render in progress
        try:
            busy = request(base + "/failed")
        finally:
            pages._heavy.release()
        assert busy.status == 503
        assert busy.headers["retry-after"] == "2"
        assert busy.headers["x-content-type-options"] == "nosniff"
        replies: list[int] = []
        threads = [
            threading.Thread(target=lambda: replies.append(request(base + "/").status)) for _ in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert replies == [200, 200, 200]  # quick pages only wait their turn


def test_a_requeue_waits_for_the_lock_another_process_holds(journal_dir: Path) -> None:
    """``flock`` is per open file: a holder elsewhere (another process, here another open) blocks it."""
    import fcntl
    import os

    (job,) = _failures(journal_dir, 1)
    fd = os.open(journal_dir / "requeue.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (hybridq.requeue([job.id], journal_dir), done.set()))
    thread.start()
    try:
        assert not done.wait(0.5)
    finally:
        os.close(fd)
    thread.join(10)
    assert done.is_set()
    assert hybridq.failed_jobs(journal_dir) == []


def test_a_vanished_ledger_segment_is_read_again(journal_dir: Path) -> None:
    import shutil

    from hybridq.ledger.store import ledger_dir

    _failures(journal_dir, 2)
    view = LedgerView(str(journal_dir))
    assert len(view.failed()) == 2
    shutil.rmtree(ledger_dir(str(journal_dir)))  # what a compaction of the ledger does, all at once
    assert view.failed() == []
    (new,) = _failures(journal_dir, 1, start=5)  # (the compaction state is the same)
    assert [f.id for f in view.failed()] == [new.id]
    assert [e.kind for e in view.entries(new.id)] == ["done"]


def test_recent_outcomes_per_queue(journal_dir: Path) -> None:
    from tests.unit.test_trace import _ledger

    hybridq.Queue("q", journal_dir).enqueue("tests.tasks.add", 1, 2)
    view = LedgerView(str(journal_dir), window_s=60)
    assert view.recent(now=100.0) == {}
    _ledger(
        journal_dir,
        Entry(EntryKind.DONE, "a", ("w", 0, 1), outcome="succeeded", at=95.0, queue="q"),
        Entry(EntryKind.DONE, "b", ("w", 0, 2), outcome="failed", at=96.0, queue="q"),
        Entry(EntryKind.DONE, "c", ("w", 0, 3), outcome="succeeded", at=10.0, queue="q"),
        Entry(EntryKind.RETRY, "d", ("w", 0, 4), at=97.0, queue="q"),
    )
    assert view.recent(now=100.0) == {"q": {"succeeded": 1, "failed": 1, "cancelled": 0}}
    assert view.recent(now=200.0) == {}


def test_a_trace_of_a_job_whose_entries_were_punched_skips_them_without_a_rebuild(journal_dir: Path) -> None:
    """A ``retry`` entry punched out of the ledger (issue 29) since the view read it (review L6).

    The view's places still name it; reading it back answers ``RecordPunched``. A read of the
    whole ledger again would skip it too (every reader skips a mapped range), so it is skipped
    at once, and the view is not rebuilt for it.
    """
    (job,) = _failures(journal_dir, 1)
    loc = (job.record.writer_id, job.record.segment, job.record.offset)
    with open_ledger_writer(str(journal_dir)) as writer:
        writer.append_many([Entry(EntryKind.RETRY, job.id, loc, attempt=1, run_at=2.0, at=1.0).to_bytes()])
    with open_ledger_writer(str(journal_dir)) as writer:  # seals the segment before
        writer.append_many([Entry(EntryKind.DONE, job.id, loc, outcome="succeeded", at=3.0).to_bytes()])
    view = LedgerView(str(journal_dir))
    assert sorted(e.kind for e in view.entries(job.id)) == ["done", "done", "retry"]
    retry = next(r for r in JournalReader(ledger_dir(str(journal_dir))).records() if b"retry" in r.payload)
    hole = Hole(retry.offset, retry.end, retry.seq, retry.seq + 1, 1)
    punch_holes(ledger_dir(str(journal_dir)), retry.writer_id, retry.segment_index, [hole])
    assert sorted(e.kind for e in view.entries(job.id)) == ["done", "done"]
    assert view.rebuilds == 1
