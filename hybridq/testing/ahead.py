"""Imported by a pool worker under test (``hybridq worker --import hybridq.testing.ahead``).

A pool process takes jobs ahead of its threads only while its recent runs are quick
(:data:`hybridq.worker.runner.AHEAD_QUICK` per thread, else none past a free thread). The torture
tier (:mod:`hybridq.testing.torture`) has one of its pools take that many ahead whatever runs, so
that jobs wait, reserved, behind long and GIL-holding ones while faults take their claims away.
"""

from hybridq.worker import runner

runner.AHEAD = runner.AHEAD_QUICK
