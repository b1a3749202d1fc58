"""The dashboard's list of recent jobs (``GET /jobs``), newest first, a page at a time, searchable.

From the forwarder's lookup index (:func:`hybridq.lookup.search.search`): every job it has read,
until it forgets a compacted one (``lookup.RETENTION_S``). A job accepted since the forwarder's
last step is not listed yet (its trace, ``/jobs/ID``, finds it in the journal). The list can be
narrowed to a task (a part of its dotted path) and a status; every value, the typed ones too, is
escaped by the template (``jobs.html``): an error is a task's text.
"""

from __future__ import annotations

from typing import Any

from hybridq.ledger.checkpoint import load_checkpoint
from hybridq.lookup import reads as lookup
from hybridq.lookup.search import STATUSES, search

__all__ = ["PER_PAGE", "STATUSES", "recent_jobs"]

#: Jobs per page.
PER_PAGE = 50
#: What :attr:`hybridq.Job.status` says of an outcome (``failed`` for one it does not name).
_ENDED = {"succeeded": "finished", "cancelled": "cancelled"}
_STATE = {"retry": "retrying", "started": "started", "dup": "duplicate"}


def recent_jobs(journal: str, at: int, task: str = "", status: str = "") -> tuple[str, dict[str, Any]]:
    """Page ``at`` of the recent jobs of ``task`` in ``status`` (the last page if there are fewer).

    Raises:
        ValueError: an unknown ``status`` (the caller checks it first: a 400).
    """
    values: dict[str, Any] = {"task": task, "status": status, "statuses": list(STATUSES), "rows": None}
    got = search(journal, task=task, status=status, limit=PER_PAGE, offset=(at - 1) * PER_PAGE)
    if got is None:
        return "jobs.html", values
    total, rows = got
    pages = max(1, -(-total // PER_PAGE))
    if at > pages:  # past the end: the last page
        at = pages
        rows = (
            search(journal, task=task, status=status, limit=PER_PAGE, offset=(at - 1) * PER_PAGE) or (0, [])
        )[1]
    checkpoint = load_checkpoint(journal)
    held = {h.job_id for h in checkpoint.held} if checkpoint is not None else set()
    values.update(
        rows=[(row, _status(row, held)) for row in rows],
        total=total,
        at=at,
        pages=pages,
        query={"task": task, "status": status},
    )
    return "jobs.html", values


def _status(row: lookup.Row, held: set[str]) -> str:
    """The job's status as the index has it (``forwarded`` or ``scheduled`` before any outcome)."""
    if row.state == "done":
        return _ENDED.get(row.outcome or "failed", "failed")
    if row.state in _STATE:
        return _STATE[row.state]
    return "scheduled" if row.id in held else "forwarded"
