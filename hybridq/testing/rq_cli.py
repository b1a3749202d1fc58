"""RQ's own command line (``rq worker ...``), as its console script runs it, with one exit race fixed.

The chaos harness (:mod:`hybridq.testing.topology`) and the tests that run a *plain* RQ worker
start it through this module (:data:`RQ`), not the ``rq`` script: the same CLI, worker classes
and job handling, but ``BaseWorker.unsubscribe`` is :func:`hybridq.rqworker.unsubscribe_promptly`.
Under redis-py 8.2, RQ's own unsubscribe joins its pub/sub thread with no time limit, and a
thread back in ``get_message(timeout=60)`` made a worker take a whole minute to exit: a burst
worker in ``test_jobs_run_under_a_plain_rq_worker`` measured 62 s, of which 60 were that wait,
and about one harness worker in 5 outlived its SIGTERM (the harness's close waited its 10 s and
killed it). A third-party race at exit, not what any test checks (the in-process tests patch it
the same way: ``tests/conftest.py``; docs/deploy.md says what users run instead).
"""

from __future__ import annotations

import sys

#: The argv prefix that runs RQ's command line this way.
RQ = [sys.executable, "-m", "hybridq.testing.rq_cli"]


def main() -> int:
    """Run ``rq`` with the patch; its exit status."""
    # Imported here: whoever only builds an argv with RQ (the harness, the tests) loads no RQ.
    from rq.cli.cli import main as rq_main  # noqa: PLC0415 - the `rq` script's (rq.cli re-exports it)
    from rq.worker.base import BaseWorker  # noqa: PLC0415

    from hybridq.rqworker import unsubscribe_promptly  # noqa: PLC0415

    BaseWorker.unsubscribe = unsubscribe_promptly  # type: ignore[method-assign]
    sys.argv[0] = "rq"
    rq_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
