"""The stats tracker's finished jobs, in any order: what a row per record gives.

A finished job's row is looked for first just after the last row finished (jobs mostly finish
in the order they were read; a bisection of the block's offsets cost about 2.5k instructions a
job: docs/benchmarks.md, "The forwarder's writes per job, again"). Any order, and a job
finished twice, must count as before.
"""

from __future__ import annotations

import random

import pytest
from hybridq.lookup.pending import PendingTracker
from hybridq.lookup.pending_blocks import BLOCK


@pytest.mark.parametrize("order", ["read", "reversed", "shuffled", "pairs swapped"])
def test_jobs_finished_in_any_order_count_as_a_row_each(order: str) -> None:
    n = 2 * BLOCK + 100  # three blocks
    locs = [("w", 1, 64 + 100 * i) for i in range(n)]
    queue = {loc: "a" if i % 3 else "b" for i, loc in enumerate(locs)}
    created = {loc: float(i) for i, loc in enumerate(locs)}
    tracker = PendingTracker()  # no journal: every block held as rows
    for loc in locs:
        tracker.saw(loc, (queue[loc], created[loc]))
    finish = list(locs)
    if order == "reversed":
        finish.reverse()
    elif order == "shuffled":
        random.Random(7).shuffle(finish)
    elif order == "pairs swapped":
        finish = [finish[i ^ 1] for i in range(n)]
    finish += finish[::5]  # some finished twice: counted once
    left = dict.fromkeys(locs)
    for k, loc in enumerate(finish):
        tracker.done(loc)
        left.pop(loc, None)
        if k % 97 == 0 or k == len(finish) - 1:
            expected: dict[str, int] = {}
            for waiting in left:
                expected[queue[waiting]] = expected.get(queue[waiting], 0) + 1
            assert tracker.pending == expected
            assert tracker.oldest() == min((created[w] for w in left), default=None)
    tracker.done(("w", 1, 65))  # not a record's offset: ignored
    tracker.done(("w", 2, 64))  # nor another segment
    assert tracker.pending == {}
