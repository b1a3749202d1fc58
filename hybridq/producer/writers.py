"""The journal writers a process's queues share, and the hook that replaces the journal in tests.

One :class:`~hybridq.journal.JournalWriter` per process, journal and durability
(:func:`shared_writer`), so the group commit of every :class:`~hybridq.producer.queue.Queue` on
a journal is one -- and a second one, its **delayed chain**, for calls whose every job runs more
than :data:`DELAYED_CHAIN_S` later (:func:`delayed_call`), so that they do not pin the segments
of the main chain (docs/journal.md, "Chains"); and :func:`install_sink`, through which
:mod:`hybridq.testing` takes the enqueues of a process instead of the journal. Apart from
:mod:`hybridq.producer.queue`, which re-exports every name.

This module must not import redis or rq.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import TYPE_CHECKING, Protocol

from hybridq.journal import Durability, JournalWriter
from hybridq.journal.format import DEFAULT_MAX_SEGMENT_BYTES
from hybridq.journal.paths import ensure_journal_dir

if TYPE_CHECKING:
    from hybridq.envelope.model import Envelope
    from hybridq.job import Job
    from hybridq.producer.queue import Queue

__all__ = [
    "DELAYED_CHAIN_S",
    "DELAYED_SEGMENT_BYTES",
    "Sink",
    "delayed_call",
    "install_sink",
    "installed_sink",
    "shared_writer",
]

# -- one writer per process and journal -----------------------------------------------------------

#: A call whose every job's ``run_at`` is more than this many seconds after the call is written
#: goes to the process's delayed chain: a journal segment is deleted only once every job in it
#: is finished, oldest first in each chain (docs/reliability.md rule 8), so one job delayed by a
#: day among immediate ones would keep a day of them on disk and in the forwarder's index
#: (docs/operations.md, "A segment that stays"). A minute is long next to the time an immediate
#: job takes to finish, and short enough that "in an hour" and "tomorrow" both qualify.
DELAYED_CHAIN_S = 60.0
#: The delayed chain's segment size. A segment goes only once sealed and all its jobs ended, and
#: delayed calls trickle in (1 in 100 jobs: a 64 MiB segment would fill over millions of jobs,
#: and the ledger segments recording its finished jobs stay as long): small segments, as for
#: the scheduler's ticks and workflows' steps.
DELAYED_SEGMENT_BYTES = 1 << 20

_writers: dict[tuple[str, Durability, bool], JournalWriter] = {}
_writers_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """Replace this module's locks in a forked child.

    Only the forking thread exists there: a lock another thread of the parent held at the fork
    stays held forever (a preforking server's worker would hang in ``enqueue``). The shared
    writers reset themselves: ``JournalWriter`` registers its own hook, which runs before this
    one (after-fork hooks run in registration order, and ``hybridq.journal`` is imported first).
    """
    global _writers_lock
    _writers_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def shared_writer(
    journal: str, durability: Durability = Durability.FSYNC, *, delayed: bool = False
) -> JournalWriter:
    """The process's writer for ``journal`` (created on first use, sealed at exit).

    Writers are thread-safe and fork-safe (a child starts chains of its own: each writer does),
    so every :class:`Queue` on the same journal shares one: its group commit then covers all of
    them. ``delayed``: the process's second writer of that journal, for the calls
    :func:`delayed_call` picks (a chain of its own, created on its first call, in segments of
    :data:`DELAYED_SEGMENT_BYTES`).
    """
    key = (os.path.realpath(ensure_journal_dir(journal)), Durability(durability), delayed)
    with _writers_lock:
        writer = _writers.get(key)
        if writer is None:
            size = DELAYED_SEGMENT_BYTES if delayed else DEFAULT_MAX_SEGMENT_BYTES
            writer = _writers[key] = JournalWriter(key[0], durability=key[1], max_segment_bytes=size)
        return writer


def delayed_call(envelopes: list[Envelope], now: float) -> bool:
    """Whether a call belongs in the delayed chain: every job delayed, none keyed.

    Delayed: it runs over DELAYED_CHAIN_S after ``now``; keyed: its id or key is not one
    ``prepare`` marked fresh (an ``idempotency_key`` or a ``job_id`` of the caller's). Whole
    calls only: a call is one atomic append (all acknowledged or none), so a call mixing
    immediate and delayed jobs stays in the main chain.
    A key (a given id is the default key) is owned by the job read first, and the forwarder
    reads a process's two chains in no set order: a keyed job stays in the main chain, where
    its order against the process's other jobs with that key is the order of the calls
    (docs/enqueue.md, "Enqueue-if-absent").
    """
    after = now + DELAYED_CHAIN_S
    for env in envelopes:
        run_at = env.run_at
        if run_at is None or run_at <= after or not env._fresh_key:
            return False
    return bool(envelopes)


@atexit.register
def _close_writers() -> None:
    with _writers_lock:
        for writer in _writers.values():
            writer.close()
        _writers.clear()


# -- the testing hook ---------------------------------------------------------------------------


class Sink(Protocol):
    """What takes every enqueue of this process instead of the journal (:mod:`hybridq.testing`)."""

    def accept(self, queue: Queue, envelopes: list[Envelope]) -> list[Job]:
        """The jobs for ``envelopes``, validated, encoded and signed as for the journal."""
        ...


_sink: Sink | None = None


def install_sink(sink: Sink | None) -> Sink | None:
    """Have ``sink`` take every enqueue in this process (``None``: the journal again).

    Returns the sink it replaces, for the caller to put back (``hybridq.testing`` nests them).
    """
    global _sink
    previous, _sink = _sink, sink
    return previous


def installed_sink() -> Sink | None:
    """The sink that takes this process's enqueues now, if any."""
    return _sink
