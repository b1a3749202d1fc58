"""The journal writers a process's queues share, and the hook that replaces the journal in tests.

One :class:`~hybridq.journal.JournalWriter` per process, journal and durability
(:func:`shared_writer`), so the group commit of every :class:`~hybridq.producer.queue.Queue` on
a journal is one; and :func:`install_sink`, through which :mod:`hybridq.testing` takes the
enqueues of a process instead of the journal. Apart from :mod:`hybridq.producer.queue`, which
re-exports every name.

This module must not import redis or rq.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import TYPE_CHECKING, Protocol

from hybridq.journal import Durability, JournalWriter
from hybridq.journal.paths import ensure_journal_dir

if TYPE_CHECKING:
    from hybridq.envelope.model import Envelope
    from hybridq.job import Job
    from hybridq.producer.queue import Queue

__all__ = ["Sink", "install_sink", "installed_sink", "shared_writer"]

# -- one writer per process and journal -----------------------------------------------------------

_writers: dict[tuple[str, Durability], JournalWriter] = {}
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


def shared_writer(journal: str, durability: Durability = Durability.FSYNC) -> JournalWriter:
    """The process's writer for ``journal`` (created on first use, sealed at exit).

    Writers are thread-safe and fork-safe (a child starts a chain of its own), so every
    :class:`Queue` on the same journal shares one: its group commit then covers all of them.
    """
    key = (os.path.realpath(ensure_journal_dir(journal)), Durability(durability))
    with _writers_lock:
        writer = _writers.get(key)
        if writer is None:
            writer = _writers[key] = JournalWriter(key[0], durability=key[1])
        return writer


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
