"""One chain's share of a group commit, and the outcomes it gives its calls.

:meth:`hybridq.producer.queue.Queue._commit` splits a group commit's calls over the process's
main and delayed chains (docs/journal.md, "Delayed jobs have a chain of their own"): one
:data:`Batch` per chain, one append each. Here: what each call of a batch gets back, its jobs or
its own error.

This module must not import redis or rq.
"""

from __future__ import annotations

from hybridq.envelope.model import Envelope
from hybridq.errors import JournalIOError
from hybridq.job import Job
from hybridq.journal import RecordId
from hybridq.producer.calls import _copy_io_error

__all__ = ["Batch", "acknowledged", "unknown"]

#: One chain's share of a group commit: (each call's place in the outcomes, its envelopes), and
#: the records of them all, in that order.
Batch = tuple[list[tuple[int, list[Envelope]]], list[bytes]]


def unknown(
    exc: JournalIOError, taken: list[tuple[int, list[Envelope]]], outcomes: list[list[Job] | BaseException]
) -> None:
    """Give each call of a failed append a :class:`JournalIOError` naming its own jobs.

    Unknown, not refused: the records may be in the file. Each caller can retry its own under
    the same keys (docs/guarantees.md, disk full).
    """
    errors = [exc, *(_copy_io_error(exc) for _ in taken[1:])]
    for err, (place, envelopes) in zip(errors, taken, strict=True):
        err.for_jobs(tuple(env.id for env in envelopes), tuple(env.idempotency_key for env in envelopes))
        outcomes[place] = err


def acknowledged(
    taken: list[tuple[int, list[Envelope]]],
    ids: list[RecordId],
    journal: str,
    outcomes: list[list[Job] | BaseException],
) -> None:
    """Give each call of an acknowledged append its jobs (``ids``: the append's records, in order)."""
    if len(taken) == 1:  # enqueue's case
        outcomes[taken[0][0]] = [Job(env, rid, journal) for env, rid in zip(taken[0][1], ids, strict=True)]
        return
    at = 0
    for place, envelopes in taken:
        end = at + len(envelopes)
        outcomes[place] = [Job(env, rid, journal) for env, rid in zip(envelopes, ids[at:end], strict=True)]
        at = end
