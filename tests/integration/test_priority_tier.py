"""The priority tier (``-m priority``, about a minute on 2 cores): the issue's 100,000-job scene.

100,000 priority-0 jobs wait (the forwarder has read and indexed them all: the run table holds
them, Redis a 1,000-job window); a priority-9 job enqueued then starts within one window's
drain, not after the backlog. The same scene with 5,000 jobs is in the default run
(tests/integration/test_priorities.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hybridq.testing.embedded import RedisServer

from tests.integration.test_priorities import check_jump
from tests.integration.test_worker_redis import Stack, stack

__all__ = ["stack"]  # the fixture, used by this module's tests

pytestmark = pytest.mark.priority


@pytest.fixture(autouse=True)
def _priority_tier_only(request: pytest.FixtureRequest) -> None:
    """Skipped unless the run asks for the tier (``-m priority``)."""
    expr = request.config.getoption("-m") or ""
    if "priority" not in expr or "not priority" in expr:
        pytest.skip("the priority tier: pytest -m priority tests/integration/test_priority_tier.py")


def test_a_priority_9_job_jumps_a_100k_job_backlog(
    redis_server: RedisServer, stack: Stack, tmp_path: Path, figures: object
) -> None:
    check_jump(stack, redis_server, tmp_path, figures, n=100_000, window=1000)
