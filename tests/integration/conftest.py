"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest
from hybridq.rqworker import SimpleWorker as HybridqSimpleWorker
from rq import SimpleWorker

from tests.support.rqwork import Work, burst_runner


@pytest.fixture(params=[SimpleWorker, HybridqSimpleWorker], ids=["rq-worker", "hybridq-worker"])
def work(request: pytest.FixtureRequest) -> Work:
    """Run the queue's jobs in this process: RQ's SimpleWorker, or hybridq's (pipelined)."""
    return burst_runner(request.param)
