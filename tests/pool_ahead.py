"""Imported by a pool worker under test (``--import tests.pool_ahead``): take ahead always.

A pool process takes jobs ahead of its threads only while its runs are quick
(:data:`hybridq.worker.runner.AHEAD_QUICK`); the tests of what happens to a job taken ahead
make it do so whatever runs.
"""

from hybridq.worker import runner

runner.AHEAD = runner.AHEAD_QUICK
