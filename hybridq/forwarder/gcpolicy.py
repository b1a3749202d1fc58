"""The cyclic garbage collector's pace while the forwarder's loop runs.

CPython collects its youngest generation after every 700 net allocations of container objects.
The forwarder allocates several per job (the harvested event's dict, its ledger entry, the
delivery, the rows' tuples) and keeps few of them, so in a 20,000-job burn-down the collector ran
about 300 times on the youngest generation, 25-29 on the middle one and 3 times over everything
(the ledger's index and the refill's cache included): 0.16-0.20 s of the forwarder's CPU, 8-10
us per job (docs/benchmarks.md, "The forwarder's CPU per job, this stop"), to find 1,300-2,000
objects in reference cycles (almost everything it frees goes by its reference count). While its
loop runs the youngest generation is collected after :data:`GEN0_THRESHOLD` allocations instead:
one or two collections in a 20,000-job burn (1 to 10 ms of CPU in all), each over at most that
many young objects, and the garbage in cycles waits at most that much longer.

Process-wide, like every setting of :mod:`gc`: the previous thresholds are put back when the loop
returns (a forwarder embedded in an application's process leaves its collector as it found it).

This module must not import redis or rq.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["GEN0_THRESHOLD", "fewer_collections"]

#: Net container allocations between two collections of the youngest generation (CPython: 700).
GEN0_THRESHOLD = 10_000


_lock = threading.Lock()
#: How many loops run inside :func:`fewer_collections` now, and the thresholds before the first.
_inside = 0
_before: tuple[int, int, int] = (700, 10, 10)


@contextlib.contextmanager
def fewer_collections() -> Iterator[None]:
    """Collect the youngest generation after :data:`GEN0_THRESHOLD` allocations, inside the block.

    The older generations keep their thresholds (each is counted in collections of the one
    below, so they run about as much less often too). A threshold set higher already is kept.
    Several forwarders in one process (tests): the first to enter sets it, the last to leave
    puts the thresholds back.
    """
    global _inside, _before  # the process has one collector
    with _lock:
        if not _inside:
            _before = gc.get_threshold()
            if _before[0] and _before[0] < GEN0_THRESHOLD:  # 0: the application turned it off
                gc.set_threshold(GEN0_THRESHOLD, *_before[1:])
        _inside += 1
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            if not _inside:
                gc.set_threshold(*_before)
