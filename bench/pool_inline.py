"""A pool process's turns run inline, without its threads or clocks (bench/pool_cpu.py --inline, bench/fwd_cpu.py).

The same calls as the engine's loop: one round trip ends the last batch of 8, starts (claims)
this one and takes the next; then this thread runs each job as a runner thread would
(``Runner._one``: the guard, the claim's check, the task, its outcome). The claims' freshness
check is off (``FRESH_S``): under callgrind a batch takes longer than 0.05 s, and a claim made
again is a call more. Nothing depends on timing, so callgrind counts the same work in each tree.
"""

from __future__ import annotations

from hybridq.worker import perform
from hybridq.worker.engine import Engine


def run_inline(engine: Engine, budget: int | None = None) -> int:
    """The jobs the engine ran, up to ``budget`` (``None``: until its queues are empty); closes it."""
    perform.FRESH_S = 3600.0
    engine._connect()
    ready, done, ran = engine.reserved.ready, [], 0
    while True:
        starting = [ready.popleft() for _ in range(min(8, len(ready)))]
        room = 8 if budget is None else min(8, budget - ran - len(starting) - len(ready))
        taken = engine.starter.exchange(done, starting, engine._taker(room) if room > 0 else None, [])
        for item in starting:
            engine.runner._one(item)
        ran += len(starting)
        done = engine._done(0.0)
        engine.reserved.held.difference_update(done)
        engine._reserve(taken)
        if not (taken or ready or starting):
            break
    engine.runner.close()
    engine.rq_worker.register_death()
    return ran
