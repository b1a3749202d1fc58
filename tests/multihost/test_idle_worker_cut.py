"""An idle worker host cut off in its blocking pop: the job it "took" is queued again, once.

An idle ``hybridq worker`` waits for jobs in a blocking pop (``BLMOVE``, up to 1 s). Cut off while
that pop waits in Redis, it still takes the next job pushed: Redis moves the job into RQ's
intermediate list, and the reply never arrives. The forwarder finds the job stranded after a
lease and queues it again. Before the fix, the job stayed in the intermediate list too, so every
later pass found it stranded again and moved it to the back of the queue: behind a backlog longer
than a lease it ran only once the backlog was gone (``stranded_requeues=7``, run last, 25 s after
the cut). Figure line ``MH idle-worker-cut ...`` (docs/reliability.md, "Many hosts").
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from hybridq.protocol import keys

from tests.support.multihost import Cluster, ProducerHost, WorkerHost, line, wait_exit

pytestmark = pytest.mark.multihost


def take_while_cut_off(cluster: Cluster, p1: ProducerHost, w1: WorkerHost, first: int) -> str | None:
    """Cut w1 off in its blocking pop and enqueue one job; its token if the pop took it, else None."""
    go = cluster.tmp_path / f"go-{first}"
    producer = cluster.produce(p1, 1, first=first, sleep=0.01, wait_for=go)
    time.sleep(1.0)  # the producer is up, waiting for the file
    cluster.cut_in_blocking_pop(w1)
    go.touch()
    wait_exit(producer)
    token = f"p1-{first:05d}"
    job_id = p1.accepted()[token][0]
    intermediate = keys.rq_intermediate("default")
    with cluster.client() as client:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            if job_id.encode() in client.lrange(intermediate, 0, -1):
                return token
            time.sleep(0.05)
    # The pop had timed out before the job came (a loaded machine): heal, let w1 run it, again.
    w1.host.heal()
    cluster.wait_finished([token])
    return None


def test_idle_worker_host_cut_off_strands_a_job_that_still_runs_behind_a_backlog(
    cluster: Cluster, figures: Callable[[str], None]
) -> None:
    p1 = cluster.producer_host("p1")
    w1 = cluster.worker_host("w1")
    cluster.wait_workers(1)
    ghost = None
    for first in range(5):
        ghost = take_while_cut_off(cluster, p1, w1, first)
        if ghost is not None:
            break
    assert ghost is not None, "the cut-off worker's pop never took the job"
    cut_at = max(at for _, at in p1.accepted().values())
    # A backlog on another worker host that lasts longer than a lease: 40 jobs queued at once,
    # then 12 jobs/s for 15 s, run by 2 threads of 0.2 s each (10 jobs/s at most).
    n = len(p1.accepted())
    wait_exit(cluster.produce(p1, 40, first=n, sleep=0.2))
    backlog = cluster.produce(p1, 180, first=n + 40, rate=12, sleep=0.2)
    cluster.worker_host("w2", threads=2)
    wait_exit(backlog)
    backlog_done_at = time.time()
    cluster.wait_finished(p1.accepted(), timeout=120)
    w1.host.heal()
    cluster.wait_ledgers([p1])

    log = (cluster.tmp_path / "p1-forward.log").read_text()
    ghost_id = p1.accepted()[ghost][0]
    requeued = log.count(f"job {ghost_id}: stranded in Redis for too long")
    starts = [r for r in cluster.runs() if r.kind == "start"]
    [ran] = [r for r in starts if r.token == ghost]
    tally = cluster.tally([p1])
    figures(
        line(
            "idle-worker-cut",
            {
                **tally,
                "stranded_requeues": requeued,
                "stranded_job_ran_after_s": f"{ran.at - cut_at:.1f}",
                "producers_stopped_after_s": f"{backlog_done_at - cut_at:.1f}",
                "ran_on": ran.host,
            },
        )
    )
    assert tally["lost"] == 0
    assert tally["dup_execution"] == 0
    assert requeued == 1  # queued again once, not moved to the back of the queue every lease
    assert ran.at < max(r.at for r in starts)  # it ran while the backlog lasted, not last
