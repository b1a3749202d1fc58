"""The failover tier: Sentinel fails over back and forth, the old master rejoining each time.

Not in the default run (about a minute): ``pytest -m failover tests/integration/test_sentinel_failovers.py``.

As S18 (test_sentinel_failover.py), but :data:`FAILOVERS` times in a row on one forwarder and one
pool worker: after each failover the dead master is started again (on its port, with no data: no
persistence), the Sentinels turn it into a replica of the new master, it syncs, and it is the one
promoted at the next failover (made to lag first, as in S18). Each failover bumps the forwarder's
epoch generation again. Figure lines: ``S18 failover-tier k=K ...`` per failover, then a total.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq import Queue

from tests.integration.test_sentinel_failover import Failover, Producer, delays, fail_over, fencing, ran_after
from tests.integration.test_worker_pool import pool
from tests.integration.test_worker_redis import (
    Stack,
    alive,
    all_succeeded,
    ledger_succeeded_ids,
    read_effects,
    stack,
    wait_status,
)
from tests.support.processes import wait_until
from tests.support.sentinel import SentinelTopology

__all__ = ["stack"]  # the fixture, used by this module's tests

pytestmark = pytest.mark.failover

#: Failovers in a row.
FAILOVERS = 3


@pytest.fixture(autouse=True)
def _failover_tier_only(request: pytest.FixtureRequest) -> None:
    """Skipped unless the run asks for the tier (``-m failover``)."""
    expr = request.config.getoption("-m") or ""
    if "failover" not in expr or "not failover" in expr:
        pytest.skip("the failover tier: pytest -m failover tests/integration/test_sentinel_failovers.py")


def test_s18_failover_tier_back_and_forth_with_the_old_master_rejoining(
    sentinel_topology: SentinelTopology,
    stack: Stack,
    journal_dir: Path,
    tmp_path: Path,
    subprocess_env: dict[str, str],
    figures: Callable[[str], None],
) -> None:
    topo = sentinel_topology
    effects = tmp_path / "effects.txt"
    forwarder = stack.forwarder(topo.url)
    worker = pool(stack, topo.url, "--processes", "1", "--threads", "4")
    producer = Producer(Queue("default", journal_dir), effects)
    failovers: list[Failover] = []
    servers = [topo.master, topo.replica]
    try:
        wait_until(lambda: len(ledger_succeeded_ids(journal_dir)) >= 30, timeout=60, what="30 jobs harvested")
        for k in range(FAILOVERS):
            old, new = servers[k % 2], servers[(k + 1) % 2]
            failovers.append(fail_over(topo, producer, journal_dir, old, new))
            wait_until(
                lambda: len(ledger_succeeded_ids(journal_dir)) > len(failovers[-1].finished) + 20, timeout=60
            )
            old.start()  # back on its port, empty: the Sentinels make it a replica of the new master
            topo.wait_following(old, new)
    finally:
        producer.stop()
    n = len(producer.tokens)
    status = wait_status(
        journal_dir,
        subprocess_env,
        all_succeeded(n),
        what=f"all {n} jobs",
        timeout=120,
        alive=alive(forwarder, worker),
    )
    assert status["failed"] == 0

    lines = read_effects(effects)
    starts = collections.Counter(x.token for x in lines if x.kind == "start")
    done = {x.token for x in lines if x.kind == "done"}
    lost = [t for t in producer.tokens if t not in done]
    reran_finished: set[str] = set()
    for k, failover in enumerate(failovers):
        first_job_s, stall_s = delays(lines, failover)
        # Only runs started after this kill count: a job that finished on an earlier master in its
        # last moments, unharvested, ran again after that failover (allowed), then was harvested.
        again = set(ran_after(lines, failover, producer.token_of))
        reran_finished |= again
        figures(
            f"S18 failover-tier k={k + 1} harvested_at_kill={len(failover.finished)} stale_entries={failover.stale} "
            f"promoted_s={failover.promoted_s:.2f} first_job_s={first_job_s:.2f} stall_s={stall_s:.2f} "
            f"reran_finished={len(again)}"
        )
    fenced, purged = fencing(worker.log(), forwarder.log())
    figures(
        f"S18 failover-tier failovers={FAILOVERS} jobs={n} fenced={fenced} purged={purged} lost={len(lost)} "
        f"reran_finished={len(reran_finished)} reruns_unharvested={sum(c - 1 for c in starts.values())}"
    )
    assert not lost, f"{len(lost)} accepted jobs never ran, e.g. {lost[:5]}"
    runs = {
        t: [round(x.at, 3) for x in lines if x.kind == "start" and x.token == t]
        for t in sorted(reran_finished)
    }
    kills = [round(f.killed_at, 3) for f in failovers]
    assert not reran_finished, f"finished jobs ran again: {runs} (kills at {kills})"
    assert all(f.stale > 0 for f in failovers), "a promoted replica did not lag"
