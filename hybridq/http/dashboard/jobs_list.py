"""The dashboard's list of recent jobs (``GET /jobs``), newest first, a page at a time.

From the forwarder's lookup index (:func:`hybridq.lookup.reads.recent`): every job it has read, until
it forgets a compacted one (``lookup.RETENTION_S``). A job accepted since the forwarder's last
step is not listed yet (its trace, ``/jobs/ID``, finds it in the journal). Every value is
escaped (:func:`~hybridq.http.dashboard.render.esc`): an error is a task's text.
"""

from __future__ import annotations

from hybridq.http.dashboard.render import error_cell, esc, job_link, pager, table, when
from hybridq.ledger.checkpoint import load_checkpoint
from hybridq.lookup import reads as lookup

__all__ = ["PER_PAGE", "recent_jobs"]

#: Jobs per page.
PER_PAGE = 50
#: What :attr:`hybridq.Job.status` says of an outcome (``failed`` for one it does not name).
_ENDED = {"succeeded": "finished", "cancelled": "cancelled"}
_STATE = {"retry": "retrying", "started": "started", "dup": "duplicate"}


def recent_jobs(journal: str, at: int) -> str:
    """Page ``at`` of the recent jobs (the last page if there are fewer), as HTML."""
    got = lookup.recent(journal, PER_PAGE, (at - 1) * PER_PAGE)
    if got is None:
        return (
            '<p class="empty">No list yet: no forwarder has read this journal since it was '
            "upgraded (the list comes from its lookup index). A job's trace works without it.</p>"
        )
    total, rows = got
    pages = max(1, -(-total // PER_PAGE))
    if at > pages:  # past the end: the last page
        at = pages
        rows = (lookup.recent(journal, PER_PAGE, (at - 1) * PER_PAGE) or (total, []))[1]
    if not rows:
        return '<p class="empty">No job yet.</p>'
    checkpoint = load_checkpoint(journal)
    held = {h.job_id for h in checkpoint.held} if checkpoint is not None else set()
    out = []
    for row in rows:
        status = _status(row, held)
        out.append(
            [
                job_link(row.id),
                esc(row.queue or "-"),
                esc(row.func or "-"),
                f'<span class="status status-{esc(status)}">{esc(status)}</span>',
                esc(row.attempt),
                esc(when(row.enq)),
                esc(when(row.ended)),
                error_cell(row.error, 200),
            ]
        )
    headers = ["job", "queue", "task", "status", "attempt", "accepted (UTC)", "ended (UTC)", "error"]
    return pager("/jobs", total, at, pages, "jobs") + table(headers, out, cls="jobs")


def _status(row: lookup.Row, held: set[str]) -> str:
    """The job's status as the index has it (``forwarded`` or ``scheduled`` before any outcome)."""
    if row.state == "done":
        return _ENDED.get(row.outcome or "failed", "failed")
    if row.state in _STATE:
        return _STATE[row.state]
    return "scheduled" if row.id in held else "forwarded"
