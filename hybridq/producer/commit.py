"""A queue's group commit: each call to the main or the delayed chain, one append (and fsync) each.

:class:`~hybridq.producer.queue.Queue` validates and encodes the calls; :class:`Appender` (one
per queue and journal) writes them through the process's shared writers
(:mod:`hybridq.producer.writers`), holds the capacity reservations until each append's outcome
is known, and nudges the forwarder (docs/journal.md, "Delayed jobs have a chain of their own").

This module must not import redis or rq.
"""

from __future__ import annotations

import time

from hybridq.envelope.model import Envelope
from hybridq.errors import JournalIOError, QueueFull
from hybridq.job import Job
from hybridq.journal import Durability, JournalWriter, RecordId
from hybridq.producer.calls import _Call, _copy_io_error
from hybridq.producer.capacity import PendingCount
from hybridq.producer.writers import delayed_call, shared_writer
from hybridq.protocol.nudge import nudge

__all__ = ["Appender"]

Outcomes = list[list[Job] | BaseException]

#: One chain's share of a group commit: (each call's place in the outcomes, its envelopes), and
#: the records of them all, in that order.
Batch = tuple[list[tuple[int, list[Envelope]]], list[bytes]]


def _unknown(exc: JournalIOError, taken: list[tuple[int, list[Envelope]]], outcomes: Outcomes) -> None:
    """Give each call of a failed append a :class:`JournalIOError` naming its own jobs.

    Unknown, not refused: the records may be in the file. Each caller can retry its own under
    the same keys (docs/guarantees.md, disk full).
    """
    errors = [exc, *(_copy_io_error(exc) for _ in taken[1:])]
    for err, (place, envelopes) in zip(errors, taken, strict=True):
        err.for_jobs(tuple(env.id for env in envelopes), tuple(env.idempotency_key for env in envelopes))
        outcomes[place] = err


def _acknowledged(
    taken: list[tuple[int, list[Envelope]]],
    ids: list[RecordId],
    journal: str,
    outcomes: Outcomes,
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


class Appender:
    """A :class:`Queue`'s appends to one journal: its writers, capacity count and last nudges."""

    def __init__(self, journal: str, nudge_name: str, pending: PendingCount | None) -> None:
        self.journal = journal
        self._nudge_name = nudge_name
        #: The capacity reservations (``None``: the queue has no capacity).
        self.pending = pending
        #: Per chain (main, delayed): (chain id, sequence number) known written before a nudge
        #: this queue sent (see :meth:`_append`).
        self._nudged: list[tuple[str, int]] = [("", 0), ("", 0)]
        #: The process's shared writers this queue appends through: main chain, delayed chain.
        self._writers: list[JournalWriter | None] = [None, None]

    def use(self, writer: JournalWriter) -> None:
        """Append every call through ``writer``, whatever its chain (the scheduler's ticks' own)."""
        self._writers = [writer, writer]

    def commit(self, calls: list[_Call], capacity: int | None, durability: Durability) -> Outcomes:
        """Append the calls' records under one fsync per chain; each call's outcome.

        The capacity check refuses a call alone (:class:`QueueFull`, nothing written). Calls
        :func:`~hybridq.producer.writers.delayed_call` picks go to the process's delayed chain,
        the others to its main chain: one append for each chain that has calls. The calls of
        one append are acknowledged together, or none is: each then gets a
        :class:`JournalIOError` naming its own jobs (any other error of the append is their
        outcome too: the other chain's calls keep theirs). A ``BaseException`` is raised, unless
        the main chain's calls have their outcomes already: then it is the delayed calls'
        outcome only, so that calls acknowledged durable are not told they failed. Thread-safe:
        ``enqueue_many`` runs it in the caller's thread, the async committer in a worker thread.
        """
        outcomes: Outcomes = []
        # Per chain (main, delayed): (its place in outcomes, its envelopes), and the payloads.
        chains: tuple[Batch, Batch] = (([], []), ([], []))
        now = time.time()
        for envelopes, call_payloads in calls:
            if self.pending is not None and capacity is not None:
                try:
                    self.pending.reserve(len(call_payloads), capacity)
                except QueueFull as exc:
                    outcomes.append(exc)
                    continue
            taken, payloads = chains[delayed_call(envelopes, now)]
            taken.append((len(outcomes), envelopes))
            outcomes.append([])
            payloads.extend(call_payloads)
        for delayed, (taken, payloads) in enumerate(chains):
            if not payloads:
                continue
            try:
                self._append(durability, delayed, taken, payloads, outcomes)
            except Exception as exc:  # its calls' outcome; the other chain's calls keep theirs
                for place, _ in taken:
                    outcomes[place] = exc
            except BaseException as exc:
                if delayed and chains[0][1]:  # the main chain's calls have their outcomes
                    for place, _ in taken:
                        outcomes[place] = exc
                    break
                if not delayed and chains[1][1] and self.pending is not None:
                    self.pending.release(len(chains[1][1]), appended=False)  # never tried
                raise
        return outcomes

    def _append(
        self,
        durability: Durability,
        delayed: int,
        taken: list[tuple[int, list[Envelope]]],
        payloads: list[bytes],
        outcomes: Outcomes,
    ) -> None:
        """Append ``payloads`` to one chain (0: main, 1: delayed); set the outcome of each call."""
        journal = self.journal
        try:
            # Opened in the try: an error opening it (EMFILE) gives the reservations back too.
            writer = self._writers[delayed]
            if writer is None or writer.closed:
                writer = self._writers[delayed] = shared_writer(journal, durability, delayed=bool(delayed))
            ids = writer.append_many(payloads)
        except BaseException as exc:
            if self.pending is not None:
                self.pending.release(len(payloads), appended=False)
            if not isinstance(exc, JournalIOError):
                raise
            _unknown(exc, taken, outcomes)
            return
        if self.pending is not None:
            self.pending.release(len(ids), appended=True)
        # Wake the forwarder with a nudge sent after our records were written. Another thread's
        # nudge does, if it read the same writer's position only once they were written:
        # threads that one fsync acknowledged together then send one nudge, not one each.
        last, nudged = ids[-1], self._nudged[delayed]
        if nudged[1] < last.seq or nudged[0] != last.writer_id:
            written = writer.written
            nudge(journal, name=self._nudge_name)
            self._nudged[delayed] = written
        _acknowledged(taken, ids, journal, outcomes)
