"""Many hosts, tested as hosts: producer and worker hosts in network namespaces, one Redis.

Every host is its own network namespace behind a switch port (tests/support/netns.py); producer
hosts run their own journal, ``hybridq forward`` and an application enqueueing jobs; worker
hosts run ``hybridq worker``. Faults are the network's: a host's port set down (a partition),
``tc`` shaping its link, a host that never comes back. Each scenario prints one figure line
``MH <scenario> ...`` (docs/reliability.md, "Many hosts"), counted from the tasks' own effects
file, the producers' acknowledgements and each forwarder's ledger.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import pytest

from tests.support.multihost import LEASE_S, Cluster, line, since, wait_exit
from tests.support.processes import run_status

pytestmark = pytest.mark.multihost


def test_baseline_two_producer_hosts_two_worker_hosts(
    cluster: Cluster, figures: Callable[[str], None]
) -> None:
    start = time.monotonic()
    p1, p2 = cluster.producer_host("p1"), cluster.producer_host("p2")
    cluster.worker_host("w1")
    cluster.worker_host("w2")
    cluster.wait_workers(2)
    producers = [cluster.produce(ph, 60, rate=30, sleep=0.02) for ph in (p1, p2)]
    for proc in producers:
        wait_exit(proc)
    tokens = [t for ph in (p1, p2) for t in ph.accepted()]
    cluster.wait_finished(tokens)
    cluster.wait_ledgers([p1, p2])

    # Each forwarder's ledger holds exactly its own jobs' outcomes, once each.
    own = {ph.name: {job_id for job_id, _ in ph.accepted().values()} for ph in (p1, p2)}
    routed = {ph.name: ph.ledger_done() for ph in (p1, p2)}
    foreign = sum(len(set(routed[n]) - own[n]) for n in own)
    tally = cluster.tally([p1, p2])
    figures(
        line(
            "baseline",
            {
                "hosts": "2p+2w",
                **tally,
                "ledger_p1": len(routed["p1"]),
                "ledger_p2": len(routed["p2"]),
                "foreign": foreign,
                "elapsed_s": since(start),
            },
        )
    )
    for name, jobs in own.items():
        assert set(routed[name]) == jobs
        assert set(routed[name].values()) == {1}
    assert tally["accepted"] == 120
    assert tally["lost"] == 0
    assert tally["dup_execution"] == 0
    assert len(cluster.runs()) == 240  # a start and a done per job, nothing else


def rate(cluster: Cluster, prefix: str, t0: float, t1: float) -> float:
    """Jobs of producer host ``prefix`` finished per second between wall times t0 and t1."""
    done = {
        r.token for r in cluster.runs() if r.kind == "done" and r.token.startswith(prefix) and t0 <= r.at < t1
    }
    return len(done) / (t1 - t0)


def test_partitioned_producer_host_keeps_accepting_and_the_other_keeps_flowing(
    cluster: Cluster, figures: Callable[[str], None]
) -> None:
    before_s, cut_s, after_s = 6.0, 10.0, 6.0
    per_s = 10
    p1, p2 = cluster.producer_host("p1"), cluster.producer_host("p2")
    cluster.worker_host("w1")
    cluster.worker_host("w2")
    cluster.wait_workers(2)
    count = int((before_s + cut_s + after_s) * per_s)
    producers = [cluster.produce(ph, count, rate=per_s, sleep=0.02) for ph in (p1, p2)]
    time.sleep(before_s)
    cut_at = time.time()
    p1.host.cut()
    time.sleep(cut_s)
    heal_at = time.time()
    p1.host.heal()
    for proc in producers:
        wait_exit(proc)
    tokens = [t for ph in (p1, p2) for t in ph.accepted()]
    cluster.wait_finished(tokens, timeout=90)
    cluster.wait_ledgers([p1, p2])
    caught_up = time.time()

    p1_acked_during = sum(1 for _, at in p1.accepted().values() if cut_at <= at < heal_at)
    starts = [r for r in cluster.runs() if r.kind == "start"]
    p1_started_during = sum(1 for r in starts if r.token.startswith("p1-") and cut_at + 1 <= r.at < heal_at)
    # When the last job p1 accepted during the partition finished, counted from the heal.
    backlog = {t for t, (_, at) in p1.accepted().items() if cut_at <= at < heal_at}
    last_done = max(r.at for r in cluster.runs() if r.kind == "done" and r.token in backlog)
    tally = cluster.tally([p1, p2])
    figures(
        line(
            "producer-partition",
            {
                **tally,
                "cut_s": f"{cut_s:g}",
                "p2_jobs_per_s_before": f"{rate(cluster, 'p2-', cut_at - before_s + 1, cut_at):.1f}",
                "p2_jobs_per_s_during": f"{rate(cluster, 'p2-', cut_at, heal_at):.1f}",
                "p1_accepted_during": p1_acked_during,
                "p1_started_during": p1_started_during,
                "p1_backlog_done_after_heal_s": f"{last_done - heal_at:.1f}",
                "all_done_after_heal_s": f"{caught_up - heal_at:.1f}",
            },
        )
    )
    assert tally["lost"] == 0
    assert tally["dup_execution"] == 0
    assert p1_acked_during >= cut_s * per_s * 0.8  # its application never noticed
    assert p1_started_during == 0  # nothing of p1's reached a worker while it was cut off
    assert rate(cluster, "p2-", cut_at, heal_at) >= per_s * 0.8  # p2's jobs kept flowing


def test_partitioned_worker_host_mid_job_another_takes_over(
    cluster: Cluster, figures: Callable[[str], None]
) -> None:
    long_s, cut_s, long_jobs, short_jobs = 5.0, 14.0, 3, 20
    p1 = cluster.producer_host("p1")
    w1 = cluster.worker_host("w1")
    cluster.wait_workers(1)
    wait_exit(cluster.produce(p1, long_jobs, sleep=long_s))
    long_tokens = set(p1.accepted())
    long_ids = {job_id for job_id, _ in p1.accepted().values()}
    # Every long job runs on w1 (the only worker host yet) when it is cut off.
    started = {r.token for r in cluster.runs() if r.kind == "start"}
    deadline = time.monotonic() + 30
    while started != long_tokens:
        assert time.monotonic() < deadline, "the long jobs did not start on w1"
        time.sleep(0.1)
        started = {r.token for r in cluster.runs() if r.kind == "start"}
    w2 = cluster.worker_host("w2")
    cluster.wait_workers(2)
    cut_at = time.time()
    w1.host.cut()
    wait_exit(cluster.produce(p1, short_jobs, first=long_jobs, sleep=0.02))
    time.sleep(cut_s - (time.time() - cut_at))
    heal_at = time.time()
    w1.host.heal()
    tokens = list(p1.accepted())
    cluster.wait_finished(tokens, timeout=90)
    cluster.wait_ledgers([p1])
    time.sleep(2 * LEASE_S + 2)  # w1's late outcomes, and anything a lapsed lease would redeliver

    runs = cluster.runs()
    starts = Counter(r.token for r in runs if r.kind == "start")
    done = Counter(r.token for r in runs if r.kind == "done")
    takeover = sorted(
        r.at - cut_at for r in runs if r.kind == "start" and r.token in long_tokens and r.host == "w2"
    )
    short_by = Counter(r.host for r in runs if r.kind == "done" and r.token not in long_tokens)
    ledger = p1.ledger_done()
    status = run_status(p1.journal, cluster.env)
    tally = cluster.tally([p1])
    figures(
        line(
            "worker-partition",
            {
                **tally,
                "lease_s": f"{LEASE_S:g}",
                "cut_s": f"{cut_s:g}",
                "long_jobs": long_jobs,
                "long_runs": sum(starts[t] for t in long_tokens),
                "long_runs_finished": sum(done[t] for t in long_tokens),
                "takeover_first_s": f"{takeover[0]:.1f}" if takeover else "-",
                "takeover_last_s": f"{takeover[-1]:.1f}" if takeover else "-",
                "short_done_by": ",".join(f"{h}:{n}" for h, n in sorted(short_by.items())),
                "status_succeeded": status["succeeded"],
                "late_ledger_entries": sum(n - 1 for n in ledger.values()),
                "healed_after_s": f"{heal_at - cut_at:.1f}",
            },
        )
    )
    assert tally["lost"] == 0
    # The outcome is recorded once, whatever ran twice: the first outcome the ledger took is the
    # job's; a late one (the other run's) is appended, ignored and logged as "ran again".
    assert status["succeeded"] == len(tokens)
    assert status["pending"] == 0
    assert set(ledger) == {job_id for job_id, _ in p1.accepted().values()}
    assert all(n == 1 for job_id, n in ledger.items() if job_id not in long_ids)
    for token in long_tokens:  # w1's run, and w2's after the lease lapsed: at most two
        assert 1 <= starts[token] <= 2, (token, starts[token])
    assert all(starts[t] == 1 for t in tokens if t not in long_tokens)
    assert w2.proc.poll() is None
