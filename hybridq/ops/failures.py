"""Jobs that failed for good: list them, and accept them again (``requeue``).

Both read the ledger and need no Redis. A requeue appends the job to the journal again (same job
id, its ``requeue`` count one higher, a new record), then marks the failure ``requeued`` in the
ledger. A crash between the two leaves the job both requeued and still listed; requeueing it
again delivers it twice, and its idempotency key runs it once. Requeues exclude one another (a
``flock`` on ``requeue.lock`` in the journal directory, across processes): two at once (a double
click, two operators) accept the job once, the second finds it no longer listed.

This module must not import redis or rq.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from hybridq.envelope.model import Envelope
from hybridq.errors import EnvelopeError, JobNotFailed
from hybridq.job import Job
from hybridq.journal.paths import default_journal, existing_journal_dir
from hybridq.journal.records import Loc
from hybridq.ledger.compacted import consistent
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.store import load_index, open_ledger_writer
from hybridq.producer.queue import shared_writer
from hybridq.protocol import EntryKind

__all__ = ["FailedJob", "JobNotFailed", "failed_job", "failed_jobs", "listed", "listed_each", "requeue"]

#: The lock file requeues hold while they read the list, append and mark (in the journal directory).
LOCK_NAME = "requeue.lock"


@dataclass(frozen=True, slots=True)
class FailedJob:
    """A job that failed for good (out of attempts, or its worker vanished too often)."""

    id: str
    func: str | None
    queue: str | None
    attempts: int
    error: str | None
    failed_at: float
    loc: Loc
    envelope: Envelope | None


def failed_jobs(journal: str | None = None) -> list[FailedJob]:
    """Every job that failed for good and was not requeued, oldest first."""
    path = existing_journal_dir(journal or default_journal())
    index = consistent(path, lambda compacted: load_index(path, compacted, keys=False))
    return listed(index)


def listed(index: LedgerIndex) -> list[FailedJob]:
    """The failures a ledger index lists (not requeued), oldest first."""
    out = [failed_job(entry) for entry in index.failed.values()]
    return sorted(out, key=lambda f: f.failed_at)


def listed_each(index: LedgerIndex, visit: Callable[[FailedJob], None]) -> None:
    """``visit`` each failure ``index`` lists, in no set order, one at a time.

    For a caller that keeps less of each than :func:`listed` does (the dashboard's failed page:
    every failure's envelope at once cost about 2.5 KB each at its peak).
    """
    index.failed.each(lambda entry: visit(failed_job(entry)))


def requeue(
    job_ids: Iterable[str],
    journal: str | None = None,
    *,
    failed: Callable[[str], list[FailedJob]] | None = None,
) -> list[Job]:
    """Accept failed jobs again; returns the new jobs.

    Raises :class:`JobNotFailed` before writing anything if any id is not a listed failure.
    ``failed(journal)`` reads the list (default :func:`failed_jobs`; the dashboard passes its
    incremental view of the ledger); it is called under the requeue lock.
    """
    path = existing_journal_dir(journal or default_journal())
    with _requeue_lock(path):
        return _requeue(path, job_ids, failed or failed_jobs)


@contextlib.contextmanager
def _requeue_lock(path: str) -> Iterator[None]:
    """Exclusive across threads and processes (``flock`` is per open file, not per process)."""
    fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _requeue(path: str, job_ids: Iterable[str], read: Callable[[str], list[FailedJob]]) -> list[Job]:
    # Under the lock: the list read here is the one a concurrent requeue left behind.
    by_id = {f.id: f for f in read(path)}
    wanted = list(dict.fromkeys(job_ids))
    for job_id in wanted:
        failed = by_id.get(job_id)
        if failed is None or failed.envelope is None:
            raise JobNotFailed(job_id)
    writer = shared_writer(path)
    jobs: list[Job] = []
    marks: list[Entry] = []
    for job_id in wanted:
        failed = by_id[job_id]
        assert failed.envelope is not None
        env = dataclasses.replace(failed.envelope, requeue=failed.envelope.requeue + 1)
        record = writer.append(env.to_bytes())
        jobs.append(Job(env, record, path))
        marks.append(Entry(EntryKind.REQUEUED, job_id, failed.loc, at=time.time(), queue=failed.queue))
    # Only after the journal has them (fsync'd): a crash before this line lists them still.
    with open_ledger_writer(path) as ledger:
        ledger.append_many(m.to_bytes() for m in marks)
    return jobs


def failed_job(entry: Entry) -> FailedJob:
    """The listed failure ``entry`` records (its envelope decoded, ``None`` if refused)."""
    env = _envelope(entry.job)
    func = entry.job.get("func") if entry.job is not None else None
    return FailedJob(
        id=entry.job_id,
        func=func if isinstance(func, str) else None,
        queue=entry.queue or (env.queue if env is not None else None),
        attempts=max(1, entry.attempt - entry.later),  # runs that said RetryLater used no attempt
        error=entry.error,
        failed_at=entry.at,
        loc=entry.loc,
        envelope=env,
    )


def _envelope(job: Mapping[str, Any] | None) -> Envelope | None:
    """The failed job's envelope, or ``None`` if there is none or this version refuses it.

    A failure recorded by an older, laxer version is still listed; it cannot be requeued (its
    envelope would be refused when read back), so ``requeue`` says it is not a listed failure.
    """
    if job is None:
        return None
    try:
        return Envelope.from_dict(job)
    except EnvelopeError:
        return None
