"""RQ's own command line (``rq worker ...``), as its console script runs it, with one exit race fixed.

Tests that run a *plain* RQ worker start it through this module (:data:`RQ`), not the ``rq``
script: the same CLI, worker classes and job handling, but ``BaseWorker.unsubscribe`` is
:func:`hybridq.rqworker.unsubscribe_promptly`. Under redis-py 8.2, RQ's own unsubscribe joins its
pub/sub thread with no time limit, and a thread back in ``get_message(timeout=60)`` made a burst
worker take a whole minute to exit: ``test_jobs_run_under_a_plain_rq_worker`` measured 62 s, of
which 60 were that wait. A third-party race at exit, not what any test checks (the in-process
tests patch it the same way: ``tests/conftest.py``).
"""

from __future__ import annotations

import sys

#: The argv prefix that runs RQ's command line this way (the child needs this checkout on its
#: ``PYTHONPATH``: the ``subprocess_env`` fixture sets it).
RQ = [sys.executable, "-m", "tests.support.rq_cli"]


def main() -> int:
    from hybridq.rqworker import unsubscribe_promptly
    from rq.cli import main as rq_main
    from rq.worker.base import BaseWorker

    BaseWorker.unsubscribe = unsubscribe_promptly  # type: ignore[method-assign]
    sys.argv[0] = "rq"
    rq_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
