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
from collections.abc import Callable

import pytest

from tests.support.multihost import Cluster, line, since, wait_exit

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
