"""The stats count a clean stop saves, through real ``hybridq forward`` processes (issue 29).

A forwarder stopped cleanly saves its count of the jobs read and not terminal (``lookup/pending.state``);
the next one takes it only if nothing it was counted from changed. Here the outcomes of a
worker's run wait in Redis across a stop, a forwarder takes the saved count and is SIGKILLed
after new jobs, and the next one counts again: at each stage the snapshot's figures
(``hybridq.stats``) must equal a full scan of the files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.ops.status import collect_status, stats
from hybridq.rqworker import SimpleWorker
from hybridq.testing.embedded import RedisServer
from hybridq.transport.rq import RQTransport

from tests.integration.test_forwarder_redis import (
    StartForwarder,
    start_forwarder,
    wait_forwarding,
)
from tests.support.processes import wait_until
from tests.support.rqwork import burst_runner

__all__ = ["start_forwarder"]  # the fixture, used here

AGES = ("oldest_pending_age_s", "forwarding_lag_s")


def scan(journal: Path) -> dict[str, Any]:
    """``hybridq status``'s figures from the files (in this process: no child per poll)."""
    return collect_status(str(journal))


def figures_match(journal: Path) -> dict[str, Any]:
    """``hybridq.stats`` (the forwarder's snapshot) and the full scan agree; returns the scan."""
    fast, slow = stats(journal), collect_status(str(journal))
    for age in AGES:
        fast.pop(age, None), slow.pop(age, None)
    assert fast == slow
    return slow


def test_the_saved_count_across_a_stop_outcomes_a_kill_and_a_restart(
    redis_server: RedisServer, start_forwarder: StartForwarder, journal_dir: Path
) -> None:
    queue = Queue("default", journal_dir)
    for i in range(100):
        queue.enqueue("tests.tasks.add", i, 1)
    transport = RQTransport(redis_server.url)
    first = Forwarder(str(journal_dir), transport, window_min=1000, window_max=1000)  # in this process
    with first:
        while first.step():
            pass
    assert (journal_dir / "lookup" / "pending.state").exists()  # saved at the clean stop

    burst_runner(SimpleWorker)(transport)  # 100 outcomes wait in Redis for the next forwarder
    second = start_forwarder(redis_server.url)
    wait_until(lambda: scan(journal_dir)["succeeded"] == 100, timeout=60, interval=0.1, what="100 outcomes")
    wait_until(
        lambda: not (journal_dir / "lookup" / "pending.state").exists(), timeout=30, what="the count taken"
    )
    for i in range(20):
        queue.enqueue("tests.tasks.add", i, 2)
    wait_until(
        lambda: scan(journal_dir)["not_yet_forwarded"] == 0, timeout=60, interval=0.1, what="20 pushed"
    )
    wait_until(lambda: figures_match_or_none(journal_dir), timeout=30, interval=0.2, what="a fresh snapshot")
    second.kill()

    snapshot = journal_dir / "stats.state"
    killed_at = snapshot.stat().st_mtime_ns
    third = start_forwarder(redis_server.url)
    wait_forwarding(third)
    wait_until(  # the third's own snapshot: written once it counted the jobs read before
        lambda: snapshot.stat().st_mtime_ns > killed_at and figures_match_or_none(journal_dir),
        timeout=30,
        interval=0.2,
        what="the third forwarder's snapshot",
    )
    out = figures_match(journal_dir)
    assert (out["accepted"], out["succeeded"], out["pending"]) == (120, 100, 20)
    third.kill()
    transport.close()


def figures_match_or_none(journal: Path) -> bool:
    """Whether the snapshot has caught up with a full scan (pending and terminal counts)."""
    fast, slow = stats(journal), collect_status(str(journal))
    return all(fast.get(k) == slow.get(k) for k in ("pending", "succeeded", "accepted", "forwarded"))
