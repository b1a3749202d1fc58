"""The cyclic garbage collector's pace in a pool process (:mod:`hybridq.worker.pool`).

A pool process makes a few dozen container objects per job (the job hash's fields, the
delivery, the run, the outcome and its event, the batch scripts' arguments and replies) and
keeps almost none: its reference counts free them. CPython still collects the youngest
generation after every 700 net container allocations, and each collection of an older
generation walks every object the process imported before the fork. In a burn-down of no-op jobs
that was about 35 µs of a pool process's ~260 µs of CPU per job (docs/benchmarks.md, "The
worker's garbage collector").

So a pool process, just after the fork: :func:`gc.freeze` moves what it inherited (the imported
modules, redis-py, RQ, the task's module) out of every generation, where no collection walks it
or writes to its pages again (reference counts still do); the youngest generation is collected
after :data:`GEN0_THRESHOLD` allocations, as the forwarder's (:mod:`hybridq.forwarder.gcpolicy`).
A failed task leaves no reference cycle (no frame of its run keeps its error:
:func:`hybridq.worker.run.perform`; an ``async def`` task is awaited in its run's asyncio task:
:mod:`hybridq.worker.acall`); what a task leaves in cycles itself waits
for a collection, now rarer (docs/worker.md says what that holds, and ``--max-memory``). A
collector turned off (threshold 0, an application's choice before the fork) stays off. The
process is the pool's own: nothing is put back.

This module must not import redis or rq.
"""

from __future__ import annotations

import gc

__all__ = ["GEN0_THRESHOLD", "pace_pool_process"]

#: Net container allocations between two collections of the youngest generation (CPython: 700).
GEN0_THRESHOLD = 10_000


def pace_pool_process() -> None:
    """Freeze what the fork inherited and collect the youngest generation less often (see above)."""
    gc.freeze()
    first, *older = gc.get_threshold()
    if first and first < GEN0_THRESHOLD:
        gc.set_threshold(GEN0_THRESHOLD, *older)
