"""The dashboard's ledger view keeps its tables in a private temporary database, not in memory.

The view lives as long as the server and lists every failure not requeued: in ``:memory:`` its
table cost about 0.4 KB of RSS per failure, forever. A temporary database keeps SQLite's cache
(2 MB) and spills the rest to a file of the temporary directory (docs/http.md, "On a big
journal"). A full or unwritable temporary directory must not make it lose or revive rows.
"""

from __future__ import annotations

import logging
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hybridq.envelope.model import Envelope
from hybridq.errors import JournalIOError
from hybridq.http.dashboard.ledger_view import LedgerView
from hybridq.ledger import failtable, tablefile
from hybridq.ledger.entries import Entry
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.store import open_ledger_writer
from hybridq.ops.failures import failed_jobs, requeue


def _failure(i: int, error: str = "ValueError: boom " * 4) -> Entry:
    env = Envelope(
        id=f"job-{i}", func="m.f", queue="q", args=[i, "x" * 200], idempotency_key=f"k-{i}", created_at=1.0
    )
    return Entry(
        "done", env.id, ("w", 1 + i // 1000, 32 + 200 * (i % 1000)), outcome="failed",
        error=error, at=float(i), queue="q", attempt=3, job=env.to_dict(),
    )  # fmt: skip


def _append(journal: str, lo: int, hi: int, error: str = "ValueError: boom " * 4) -> None:
    ledger = open_ledger_writer(journal)
    for first in range(lo, hi, 1000):
        ledger.append_many(_failure(i, error).to_bytes() for i in range(first, min(hi, first + 1000)))
    ledger.close()


def test_the_views_tables_are_a_temporary_database_and_other_readers_stay_in_memory(tmp_path: Path) -> None:
    view = LedgerView(str(tmp_path))
    plain = KeyTable()
    try:
        # ":memory:" answers "memory"; a temporary database (""), which can spill, "delete".
        assert view._index.keys.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        assert plain.execute("PRAGMA journal_mode").fetchone()[0] == "memory"
    finally:
        plain.close()


_VIEW = textwrap.dedent(
    """
    import sys
    from hybridq.http.dashboard.ledger_view import LedgerView

    def peak_kb():  # VmHWM: this process's own peak (ru_maxrss keeps the forking parent's)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))

    view = LedgerView(sys.argv[1])
    before = peak_kb()
    view.was_requeued("job-0")  # reads the whole ledger: what the view keeps, not a page's render
    print(len(view._index.failed), (peak_kb() - before) // 1024)
    """
)


def _measured(script: str, journal: str, tmp_path: Path) -> list[str]:
    """What ``script`` prints about ``journal``, run in a process of its own (its peak RSS)."""
    out = subprocess.run(
        [sys.executable, "-c", script, journal],
        capture_output=True,
        text=True,
        check=True,
        env={"TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)},
        timeout=120,
    )
    return out.stdout.split()


def test_the_view_listing_many_failures_does_not_hold_their_rows_in_memory(tmp_path: Path) -> None:
    journal = str(tmp_path / "journal")
    _append(journal, 0, 40_000)
    listed, grown_mb = map(int, _measured(_VIEW, journal, tmp_path))
    assert listed == 40_000
    # Measured: 36 MB with the table in memory, 17 MB in a temporary database with the view's
    # map of each job's ledger entries in memory, 6 MB with that map a table too.
    assert grown_mb < 12, f"peak RSS grew {grown_mb} MB while reading 40,000 failures"


def test_where_each_jobs_entries_are_is_a_table_of_the_temporary_database(tmp_path: Path) -> None:
    # A dict of every job's ledger places grew with the live ledger, failures or not: 141 MB of
    # peak RSS for 500,000 successes, 8 MB as a table (docs/http.md, "On a big journal").
    journal = str(tmp_path)
    _append(journal, 0, 2500)
    view = LedgerView(journal)
    assert [e.job_id for e in view.entries("job-7")] == ["job-7"]
    assert view._places == []  # all written
    db = view._index.keys
    assert db.execute("SELECT count(*) FROM places").fetchone()[0] == 2500
    _append(journal, 7, 8)  # a second entry of job-7: both, in ledger order
    assert [e.at for e in view.entries("job-7")] == [7.0, 7.0]
    assert db.execute("SELECT count(*) FROM places").fetchone()[0] == 2501
    assert view.entries("no-such-job") == []


def test_a_full_temporary_directory_met_finding_a_jobs_entries_falls_back_to_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _append(str(tmp_path), 0, 100)
    view = LedgerView(str(tmp_path))
    assert len(view.entries("job-3")) == 1
    spilled = view._index.keys

    def full(sql: str, params: Any = ()) -> Any:
        exc = sqlite3.OperationalError("database or disk is full")
        exc.sqlite_errorcode = 13  # type: ignore[attr-defined]
        raise exc

    monkeypatch.setattr(spilled, "execute", full)
    with caplog.at_level(logging.WARNING, logger="hybridq.http"):
        assert [e.job_id for e in view.entries("job-4")] == ["job-4"]
    assert "keeps its tables in memory" in caplog.text
    assert view._index.keys is not spilled
    assert view._index.keys.execute("PRAGMA journal_mode").fetchone()[0] == "memory"
    assert view.rebuilds == 2


def test_a_full_temporary_directory_neither_loses_nor_revives_a_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # More rows than a commit holds (COMMIT_ROWS, made 2,000 here): the failed statement rolls
    # back rows of records the view is past. It reads everything again, in memory once the spill
    # failed (on main: 26,952 of 31,999 listed with 20,000 a commit, and job-7 listed again).
    monkeypatch.setattr(tablefile, "COMMIT_ROWS", 2000)
    journal = str(tmp_path)
    _append(journal, 0, 2500)
    view = LedgerView(journal)
    view.failed()
    requeue(["job-7"], journal, failed=view.failed)
    _append(journal, 2500, 3200)
    db = view._index.keys._db
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count={pages + 5}")  # the temporary directory is full
    with caplog.at_level(logging.WARNING, logger="hybridq.http"):
        shown = {f.id for f in view.failed()}
    assert shown == {f.id for f in failed_jobs(journal)}
    assert "job-7" not in shown
    assert len(shown) == 3199
    assert "keeps its tables in memory" in caplog.text
    assert view._index.keys.execute("PRAGMA journal_mode").fetchone()[0] == "memory"


def test_an_error_of_the_views_table_names_the_temporary_directory(tmp_path: Path) -> None:
    view = LedgerView(str(tmp_path))
    db = view._index.keys._db
    db.execute(f"PRAGMA max_page_count={db.execute('PRAGMA page_count').fetchone()[0]}")

    def fill() -> None:
        for i in range(1000):
            view._index.failed.setdefault(("w", 1, 32 + 200 * i), _failure(i))
        view._index.keys.commit()

    with pytest.raises(JournalIOError) as raised:
        fill()
    assert "temporary" in str(raised.value)
    assert "TMPDIR" in str(raised.value)


def test_a_full_temporary_directory_met_reading_the_list_back_falls_back_to_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reading rows back can write the cache's dirty pages out: SQLITE_FULL from listed()'s
    # SELECT. Every page answered 503 before (a rebuild in the same temporary directory).
    _append(str(tmp_path), 0, 100)
    items = failtable.FailureTable.items

    def full_when_spilled(self: failtable.FailureTable) -> Any:
        if self.file.spill:
            exc = sqlite3.OperationalError("database or disk is full")
            exc.sqlite_errorcode = 13  # type: ignore[attr-defined]
            raise exc
        return items.__wrapped__(self)  # type: ignore[attr-defined]

    monkeypatch.setattr(failtable.FailureTable, "items", failtable.mapped(full_when_spilled))
    view = LedgerView(str(tmp_path))
    assert len(view.failed()) == 100
    assert len(view.failed()) == 100
    assert view.rebuilds == 2  # the first read, then one in memory


_PAGE = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from hybridq.http.config import ServeConfig
    from hybridq.http.dashboard import routes
    from hybridq.http.dashboard.failed import FailedPages
    from hybridq.http.dashboard.filters import Filter
    from hybridq.ops.failures import requeue

    def grown_mb(before):
        with open("/proc/self/status") as f:
            peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak starts again from the current RSS
        with open("/proc/self/status") as f:
            now = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
        return (peak - before) // 1024, now

    pages = routes(ServeConfig(journal=Path(sys.argv[1])))[0].endpoint.__self__
    failed = FailedPages(pages)
    pages.view.was_requeued("job-0")  # the view's own read first: only the page is measured
    _, start = grown_mb(0)
    _, page = failed._failed("sid", "failed", Filter.parse({}), 1, None)
    page_mb, start = grown_mb(start)
    job = page["jobs"][0]
    requeue([job.id], sys.argv[1], failed=failed._listed([job.id]))
    requeue_mb, _ = grown_mb(start)
    print(page["total"], page["actionable"], job.id, job.call[:9], len(job.error), page_mb, requeue_mb)
    """
)


def test_the_failed_page_and_a_requeue_keep_only_their_own_jobs_whole(tmp_path: Path) -> None:
    # Every listed failure was made a FailedJob, envelope, call text and error included, for
    # each render of /failed, and for each requeue: with 4 KB tracebacks, 10,000 failures cost
    # a render 106 MB of peak RSS and a requeue 13 MB; 4 MB and 0 MB now.
    journal = str(tmp_path / "journal")
    _append(journal, 0, 10_000, error="Traceback: boom\n" * 250)
    total, actionable, newest, call, error, page_mb, requeue_mb = _measured(_PAGE, journal, tmp_path)
    assert (total, actionable, newest, call, error) == ("10000", "10000", "job-9999", '{"args":', "4000")
    assert int(page_mb) < 20, f"peak RSS grew {page_mb} MB rendering one page of 10,000 failures"
    assert int(requeue_mb) < 20, f"peak RSS grew {requeue_mb} MB requeueing one of 10,000 failures"
    assert "job-9999" not in {f.id for f in failed_jobs(journal)}


def test_a_job_requeued_between_the_count_and_its_page_is_shown_with_no_call(tmp_path: Path) -> None:
    from hybridq.http.config import ServeConfig
    from hybridq.http.dashboard import routes
    from hybridq.http.dashboard.failed import FailedPages
    from hybridq.http.dashboard.filters import Filter

    journal = str(tmp_path)
    _append(journal, 0, 3)
    pages = routes(ServeConfig(journal=tmp_path))[0].endpoint.__self__  # type: ignore[attr-defined]
    failed = FailedPages(pages)
    everyone = failed.failures(Filter.parse({}))
    assert [(j.call, j.error) for j in everyone] == [("", None)] * 3  # kept briefly
    requeue(["job-1"], journal, failed=failed._listed(["job-1"]))
    shown = failed.shown(everyone)
    assert [j.id for j in shown] == ["job-0", "job-1", "job-2"]
    assert shown[1].call is None
    assert shown[0].call is not None
    assert shown[0].error == "ValueError: boom " * 4
