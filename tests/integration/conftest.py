"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest
from hybridq.rqworker import SimpleWorker as HybridqSimpleWorker
from rq import SimpleWorker

from tests.support.rqwork import Work, burst_runner
from tests.support.tiers import deselect_tiers


@pytest.fixture(params=[SimpleWorker, HybridqSimpleWorker], ids=["rq-worker", "hybridq-worker"])
def work(request: pytest.FixtureRequest) -> Work:
    """Run the queue's jobs in this process: RQ's SimpleWorker, or hybridq's (pipelined)."""
    return burst_runner(request.param)


#: Tiers of this directory left out of the default run: each runs when ``-m`` names it.
TIERS = ("pool", "limits", "workflows", "chaos")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the tests of a tier (``pool``, ``limits``, ...) unless the ``-m`` expression names it."""
    deselect_tiers(config, items, TIERS)
