"""Tasks registered with ``@hybridq.task``: a worker that imports this module may run them."""

from __future__ import annotations

import hybridq

from tests import tasks


@hybridq.task()
def record(path: str, token: str) -> str:
    """Append ``token`` to ``path`` (like ``tests.tasks.record``), as a registered task."""
    return tasks.record(path, token)
