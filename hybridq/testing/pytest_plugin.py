"""hybridq's pytest plugin (entry point ``pytest11``): fixtures for testing your own code.

* ``hybridq_queue``: a :class:`~hybridq.testing.LocalQueue` active for the test: every enqueue
  and ``.delay()`` of the process goes to it, and its jobs run when the test calls ``drain()``.
* ``hybridq_eager``: the same in eager mode: each job runs at ``enqueue``, its failure raised.

Each is undone when the test ends, whatever happens in it (docs/testing.md). Loaded by pytest in
every run where hybridq is installed, so this module imports nothing until a fixture is used.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from hybridq.testing.local import LocalQueue

__all__ = ["hybridq_eager", "hybridq_queue"]


@pytest.fixture
def hybridq_queue() -> Iterator[LocalQueue]:
    """Jobs enqueued during the test run when it calls ``hybridq_queue.drain()``."""
    from hybridq.testing.local import LocalQueue  # noqa: PLC0415 - only when a test asks for it

    with LocalQueue() as queue:
        yield queue


@pytest.fixture
def hybridq_eager() -> Iterator[LocalQueue]:
    """Jobs enqueued during the test run at ``enqueue``; a job that fails raises there."""
    from hybridq.testing.local import LocalQueue  # noqa: PLC0415 - only when a test asks for it

    with LocalQueue(eager=True) as queue:
        yield queue
