"""Questions over many jobs of the lookup index: search by task and status, per-queue and per-minute figures.

The dashboard asks them (docs/dashboard.md); they read the index the forwarder keeps
(:mod:`hybridq.lookup.reads`), so they lag the ledger by at most one forwarder step and know
nothing of a job the forwarder has not read yet. Each is one read-only statement; the index has
no secondary index (the forwarder's writes stay as they are), so each is a scan of its rows
(docs/dashboard.md gives the measured cost).

This module must not import redis or rq.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridq.lookup.reads import COLUMNS, Row, query

__all__ = [
    "STATUSES",
    "Minute",
    "QueueFigures",
    "Retrying",
    "activity",
    "queue_figures",
    "retrying",
    "search",
]

#: A status as :attr:`hybridq.Job.status` (and the dashboard) names it -> its condition on a row.
#: ``waiting``: read by the forwarder, no outcome and no run yet (forwarded, or held until its time).
STATUSES = {
    "finished": "state = 'done' AND outcome = 'succeeded'",
    "failed": "state = 'done' AND coalesce(outcome, 'failed') NOT IN ('succeeded', 'cancelled')",
    "cancelled": "state = 'done' AND outcome = 'cancelled'",
    "retrying": "state = 'retry'",
    "started": "state = 'started'",
    "duplicate": "state = 'dup'",
    "waiting": "state IS NULL",
}


def search(
    journal: str, *, task: str = "", status: str = "", limit: int = 50, offset: int = 0
) -> tuple[int, list[Row]] | None:
    """How many jobs match, and ``limit`` of them from ``offset``, newest accepted first.

    Args:
        journal: the journal directory.
        task: a part of the task's dotted path (case-sensitive; empty: any task).
        status: one of :data:`STATUSES` (empty: any).
        limit: rows to return.
        offset: rows to skip.

    Returns:
        ``None``: no index (yet), or it cannot be read now.

    Raises:
        ValueError: ``status`` is not one of :data:`STATUSES`.
    """
    where, params = _where(task, status)
    counted = query(journal, f"SELECT count(*) FROM jobs WHERE {where}", params)  # noqa: S608 - constants
    rows = query(
        journal,
        f"{COLUMNS} WHERE {where} ORDER BY enq DESC, id DESC LIMIT ? OFFSET ?",
        (*params, limit, offset),
    )
    if counted is None or rows is None:
        return None
    return int(counted[0][0]), [Row(*row) for row in rows]


def _where(task: str, status: str) -> tuple[str, tuple[str, ...]]:
    """The condition of a search (built from constants only: the values are parameters)."""
    if status and status not in STATUSES:
        raise ValueError(f"unknown status {status!r}: one of {', '.join(STATUSES)}")
    conditions = [STATUSES[status]] if status else []
    params: tuple[str, ...] = ()
    if task:
        conditions.append("instr(func, ?) > 0")
        params = (task,)
    return " AND ".join(conditions) or "1", params


@dataclass(frozen=True, slots=True)
class Retrying:
    """A job whose last run failed, waiting for its next one: what the dashboard lists and cancels."""

    id: str
    queue: str | None
    func: str | None
    attempt: int
    #: When its last run failed (a row indexed by a version that did not keep it: its acceptance).
    at: float
    #: ``None`` when not asked for (``errors=False``).
    error: str | None
    #: Its record in the journal (a cancel's target), and how far it got: together, its current run.
    loc: tuple[str, int, int]

    @property
    def run(self) -> tuple[str, str, int, int, int]:
        """The job and its current run: another failure of it (a new attempt) is another one."""
        return (self.id, *self.loc, self.attempt)


#: A retrying row's last failure (``ended``, kept by the index while it retries).
_FAILED_AT = "coalesce(ended, enq, 0)"


def retrying(
    journal: str,
    *,
    task: str = "",
    error: str = "",
    between: tuple[float | None, float | None] = (None, None),
    limit: int = 50,
    offset: int = 0,
    oldest_first: bool = False,
    errors: bool = True,
) -> tuple[int, list[Retrying]] | None:
    """How many retrying jobs match, and ``limit`` of them from ``offset``, by last failure.

    Filtered and ordered by SQLite, so only the rows asked for are read into memory (a bulk
    action asks for ids and locations only: ``errors=False``).

    Args:
        journal: the journal directory.
        task: a part of the task's dotted path (case-sensitive; empty: any task).
        error: a part of the error text, in any case (empty: any).
        between: ``[since, until)`` of the last failure (``None``: open).
        limit: rows to return.
        offset: rows to skip.
        oldest_first: the oldest failure first (else the newest).
        errors: whether to read each row's error text.

    Returns:
        ``None``: no index (yet), or it cannot be read now.
    """
    where, task_params = _where(task, "retrying")
    params: list[object] = list(task_params)
    if error:
        where += " AND casefold_in(?, error)"
        params.append(error.casefold())
    for bound, op in zip(between, (">=", "<"), strict=True):
        if bound is not None:
            where += f" AND {_FAILED_AT} {op} ?"
            params.append(bound)
    order = "ASC" if oldest_first else "DESC"
    counted = query(journal, f"SELECT count(*) FROM jobs WHERE {where}", tuple(params))  # noqa: S608 - constants
    rows = query(
        journal,
        f"SELECT id, queue, func, attempt, {_FAILED_AT}, {'error' if errors else 'NULL'}, writer, seg, off"  # noqa: S608
        f" FROM jobs WHERE {where} ORDER BY {_FAILED_AT} {order}, id {order} LIMIT ? OFFSET ?",
        (*params, limit, offset),
    )
    if counted is None or rows is None:
        return None
    return int(counted[0][0]), [
        Retrying(job_id, queue, func, attempt, at, text, (writer, seg, off))
        for job_id, queue, func, attempt, at, text, writer, seg, off in rows
    ]


@dataclass(frozen=True, slots=True)
class QueueFigures:
    """What the index says of one queue's jobs that have not ended."""

    #: Read by the forwarder, no run yet (forwarded or held); the oldest one's acceptance time.
    waiting: int
    oldest_waiting: float | None
    #: A run in flight (its started event harvested), and waiting for their next attempt.
    running: int
    retrying: int


_PER_QUEUE = """
SELECT coalesce(queue, '?'), sum(state IS NULL), min(CASE WHEN state IS NULL THEN enq END),
       sum(state = 'started'), sum(state = 'retry')
FROM jobs WHERE state IS NULL OR state <> 'done' GROUP BY 1
"""


def queue_figures(journal: str) -> dict[str, QueueFigures] | None:
    """Per queue, its jobs that have not ended (``None``: no index, or it cannot be read now)."""
    rows = query(journal, _PER_QUEUE)
    if rows is None:
        return None
    return {q: QueueFigures(int(w or 0), oldest, int(r or 0), int(t or 0)) for q, w, oldest, r, t in rows}


@dataclass(frozen=True, slots=True)
class Minute:
    """The outcomes of one minute: how many, and how long they took from acceptance to outcome."""

    start: float
    succeeded: int
    failed: int
    #: Seconds from acceptance to outcome (a retried job's includes its retries), mean and longest.
    latency_mean: float | None
    latency_max: float | None


_ACTIVITY = """
SELECT CAST(ended / ? AS INTEGER), count(*), sum(outcome = 'succeeded'),
       avg(ended - enq), max(ended - enq)
FROM jobs WHERE state = 'done' AND ended >= ? AND ended < ? GROUP BY 1
"""


def activity(journal: str, since: float, until: float, bucket_s: int = 60) -> list[Minute] | None:
    """The outcomes from ``since`` to ``until``, per ``bucket_s`` (empty buckets included).

    The buckets are aligned to ``bucket_s`` (the first holds ``since``, the last ``until``).

    ``failed`` counts every outcome that is not a success (cancelled ones too, as ``status`` does).
    ``None``: no index, or it cannot be read now.
    """
    rows = query(journal, _ACTIVITY, (bucket_s, since, until))
    if rows is None:
        return None
    by_bucket = {int(b): (int(n), int(ok or 0), mean, top) for b, n, ok, mean, top in rows}
    out = []
    for bucket in range(int(since // bucket_s), int(until // bucket_s) + 1):
        n, ok, mean, top = by_bucket.get(bucket, (0, 0, None, None))
        out.append(Minute(bucket * bucket_s, ok, n - ok, mean, top))
    return out
