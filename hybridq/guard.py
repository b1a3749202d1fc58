"""The RQ job class of hybridq workers: RQ imports no function a job hash names but hybridq's.

RQ imports whatever dotted path a job hash names, as its function or as one of its callbacks,
before any hybridq code runs: with RQ's own job class, whoever can write a job hash to Redis
runs ``os.system`` on the workers. :class:`Job` checks each path first. ``hybridq worker`` uses
it; a plain RQ worker takes it as ``rq worker --job-class hybridq.worker.Job`` (re-exported
there) or ``RQ_JOB_CLASS=hybridq.worker.Job``.
"""

from __future__ import annotations

import logging
from typing import Any

from rq.job import Job as RQJob

from hybridq.allow import allowed, refusal
from hybridq.signing import keyring

__all__ = ["ENTRY_POINT", "Job", "NotAllowed"]

log = logging.getLogger("hybridq.worker")

#: The function of every RQ job the forwarder pushes.
ENTRY_POINT = "hybridq.worker.execute"


class NotAllowed(Exception):
    """The job names a function this worker may not run (see :mod:`hybridq.allow`)."""


class Job(RQJob):
    """An RQ job that imports nothing but hybridq's entry point, or a function the worker allows.

    Each path is checked before RQ imports it: :data:`ENTRY_POINT` passes; another path passes
    only if :func:`hybridq.allow.allowed` says so and this worker holds no signing key (a job
    naming a task directly would carry no signature). Anything else raises :class:`NotAllowed`,
    and RQ marks the job failed.
    """

    @property
    def func(self) -> Any:
        """The job's function, once every path the job names passed the check."""
        name = self.func_name
        # RQ would call getattr(instance, name): a method of a JSON value, not an import, but
        # hybridq jobs never have an instance.
        if self.instance is not None:
            raise NotAllowed(f"job {self.id}: a job with an instance is not allowed on this worker")
        _check_path(self.id, "function", name)
        # The callbacks too, before the function runs (RQ imports them only after it).
        for callback in (
            self._success_callback_name,
            self._failure_callback_name,
            self._stopped_callback_name,
        ):
            _check_path(self.id, "callback", callback)
        return super().func

    @property
    def success_callback(self) -> Any:
        """RQ's, once its path passed the check."""
        _check_path(self.id, "callback", self._success_callback_name)
        return super().success_callback

    @property
    def failure_callback(self) -> Any:
        """RQ's, once its path passed the check (RQ calls it for a job whose function was refused)."""
        _check_path(self.id, "callback", self._failure_callback_name)
        return super().failure_callback

    @property
    def stopped_callback(self) -> Any:
        """RQ's, once its path passed the check."""
        _check_path(self.id, "callback", self._stopped_callback_name)
        return super().stopped_callback


def _check_path(job_id: str, what: str, path: object) -> None:
    """Raise :class:`NotAllowed` unless RQ may import ``path`` (``None``: nothing to import)."""
    if path is None or path == "" or (what == "function" and path == ENTRY_POINT):
        return
    if not isinstance(path, str):
        message = f"job {job_id}: its {what} is not a dotted path"
    elif keyring() is not None:
        message = (
            f"job {job_id}: {path} is not hybridq's entry point ({ENTRY_POINT}), and this worker "
            "verifies signatures: it runs only hybridq jobs (see docs/security.md)"
        )
    elif allowed(path):
        return
    else:
        message = f"job {job_id}: {what} {refusal(path)}"
    log.error("refused RQ job %s without importing anything: %s", job_id, message)
    raise NotAllowed(message)
