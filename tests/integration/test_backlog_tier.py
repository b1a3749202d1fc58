"""The backlog tier (``-m backlog``, about 5 minutes on 2 cores): 200,000 jobs through a capped Redis.

The issue's "done when" at scale: 200,000 jobs (~200 bytes of arguments: about 550 MB of Redis if
queued at once) drain through ``maxmemory 16mb`` and ``noeviction``; each runs once, ``used_memory``
stays under the limit at every sample. The forwarder's RSS is not flat yet: what remains O(jobs)
until the ledger index moves to disk (phase 29b) costs about 0.7 KB per job drained until its
64 MiB segment is compacted (docs/forwarder.md, "The window"); the test holds it under 1 KB per
job (from the first quarter's median to the peak), a guard against a regression, not the
issue's bound.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from hybridq.testing.embedded import RedisServer

from tests.integration.test_backlog_window import drain_scene
from tests.integration.test_worker_redis import Stack, stack
from tests.support.redis import MakeRedisServer

__all__ = ["stack"]  # the fixture, used by this module's tests

pytestmark = pytest.mark.backlog


@pytest.fixture(autouse=True)
def _backlog_tier_only(request: pytest.FixtureRequest) -> None:
    """Skipped unless the run asks for the tier (``-m backlog``)."""
    expr = request.config.getoption("-m") or ""
    if "backlog" not in expr or "not backlog" in expr:
        pytest.skip("the backlog tier: pytest -m backlog tests/integration/test_backlog_tier.py")


def test_200k_jobs_drain_through_a_16mb_redis_once_with_flat_memory(
    make_redis_server: MakeRedisServer, stack: Stack, journal_dir: Path, tmp_path: Path, figures: object
) -> None:
    server: RedisServer = make_redis_server(
        extra_args=["--maxmemory", "16mb", "--maxmemory-policy", "noeviction"]
    )
    n = 200_000
    took, sampler, _, _ = drain_scene(server, stack, journal_dir, tmp_path, n, pad=200, timeout_s=1500)
    rss = [kb for kb in sampler.rss_kb if kb]
    early = statistics.median(rss[: max(1, len(rss) // 4)])
    assert max(rss) - early < n, (early, max(rss))  # KB: under 1 KB per job
    figures(  # type: ignore[operator]
        f"backlog tier: {n} jobs in {took:.0f} s ({n / took:.0f}/s), Redis peak "
        f"{max(sampler.used) / 2**20:.1f} of 16 MB, queue peak {max(sampler.llen)}, forwarder RSS "
        f"{early / 1024:.0f} MB early, {max(rss) / 1024:.0f} MB peak, {rss[-1] / 1024:.0f} MB last"
    )
