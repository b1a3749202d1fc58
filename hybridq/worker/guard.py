"""The RQ job class of hybridq workers: RQ imports no function a job hash names but hybridq's.

RQ imports whatever dotted path a job hash names, as its function or as one of its callbacks,
before any hybridq code runs: with RQ's own job class, whoever can write a job hash to Redis
runs ``os.system`` on the workers. :class:`Job` resolves each path itself instead, with
:func:`hybridq.security.allow.resolve` (what ``execute`` uses too), so RQ's ``import_attribute`` never
sees a path but hybridq's entry point. ``hybridq worker`` uses it; a plain RQ worker takes it
as ``rq worker --job-class hybridq.worker.Job`` (re-exported there) or
``RQ_JOB_CLASS=hybridq.worker.Job``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from rq.job import UNEVALUATED
from rq.job import Job as RQJob

from hybridq.errors import NotAllowed
from hybridq.protocol import ENTRY_POINT
from hybridq.security.allow import resolve
from hybridq.security.signing import keyring

__all__ = ["ENTRY_POINT", "Job", "NotAllowed"]

log = logging.getLogger("hybridq.worker")


class Job(RQJob):
    """An RQ job that imports nothing but hybridq's entry point, or a function the worker allows.

    Each path is checked before anything is imported for it: :data:`ENTRY_POINT` passes (RQ
    imports it); another path passes only if this worker holds no signing key (a job naming a
    task directly would carry no signature), and is then resolved by
    :func:`hybridq.security.allow.resolve`, never by RQ. Anything else raises :class:`NotAllowed`, and
    RQ marks the job failed.
    """

    #: The queues the worker serves, when known (``hybridq worker``: :meth:`serving_only`); a
    #: job for another queue is not run (``hybridq.worker.admit.misrouted``).
    serving: ClassVar[frozenset[str] | None] = None

    @classmethod
    def serving_only(cls, queues: Iterable[str]) -> type[Job]:
        """This class, for a worker that serves ``queues`` (and knows it)."""
        return type(cls.__name__, (cls,), {"serving": frozenset(queues), "__module__": cls.__module__})

    def restore(self, raw_data: Any) -> Any:
        """RQ's, less what makes a worker reach out or run a job again (hybridq writes none).

        ``webhooks`` (RQ 3: an HTTP request, to a URL and with headers the hash chooses, with a
        failed job's traceback, and a timeout that holds the worker) and ``repeats_left`` /
        ``repeat_intervals`` (RQ enqueues the job again after it succeeds: a replay) are
        dropped, with a warning. Whoever writes to Redis writes these fields, not a producer.
        """
        restored = super().restore(raw_data)
        dropped = [name for name in ("webhooks", "repeats_left", "repeat_intervals") if getattr(self, name)]
        if dropped:
            log.warning(
                "job %s: ignoring %s in its RQ job hash (hybridq never sets them)",
                self.id,
                ", ".join(dropped),
            )
        self.webhooks = []
        self.repeats_left = None
        self.repeat_intervals = None
        return restored

    def send_webhooks(self, status: Any, *, exc_string: str | None = None) -> None:
        """Nothing: a hybridq worker sends no webhook, whatever a job hash holds."""

    @property
    def func(self) -> Any:
        """The job's function, once every path the job names passed the check."""
        name = self.func_name
        # RQ would call getattr(instance, name): a method of a JSON value, not an import, but
        # hybridq jobs never have an instance.
        if self.instance is not None:
            raise NotAllowed(f"job {self.id}: a job with an instance is not allowed on this worker")
        func = _check_path(self.id, "function", name)
        # The callbacks too, before the function runs (RQ would import them only after it).
        self._resolve_callbacks()
        return super().func if func is None else func

    def _resolve_callbacks(self) -> None:
        """Resolve each callback the job names (hybridq's way), so that RQ's lookup never runs."""
        for attr, name in (
            ("_success_callback", self._success_callback_name),
            ("_failure_callback", self._failure_callback_name),
            ("_stopped_callback", self._stopped_callback_name),
        ):
            if getattr(self, attr) is UNEVALUATED and name:
                setattr(self, attr, _check_path(self.id, "callback", name))

    @property
    def success_callback(self) -> Any:
        """RQ's, once resolved by hybridq (RQ then returns it without importing anything)."""
        self._resolve_callbacks()
        return super().success_callback

    @property
    def failure_callback(self) -> Any:
        """RQ's, once resolved by hybridq (RQ calls it for a job whose function was refused)."""
        self._resolve_callbacks()
        return super().failure_callback

    @property
    def stopped_callback(self) -> Any:
        """RQ's, once resolved by hybridq."""
        self._resolve_callbacks()
        return super().stopped_callback


def _check_path(job_id: str, what: str, path: object) -> Callable[..., Any] | None:
    """What ``path`` names, if this worker may run it; ``None`` for nothing, or the entry point.

    Raises :class:`NotAllowed` otherwise, having imported nothing outside the allowed modules.
    """
    if path is None or path == "" or (what == "function" and path == ENTRY_POINT):
        return None
    if not isinstance(path, str):
        message = f"job {job_id}: its {what} is not a dotted path"
    elif keyring() is not None:
        message = (
            f"job {job_id}: {path} is not hybridq's entry point ({ENTRY_POINT}), and this worker "
            "verifies signatures: it runs only hybridq jobs (see docs/security.md)"
        )
    else:
        try:
            return resolve(path)
        except NotAllowed as exc:
            message = f"job {job_id}: {what} {exc}"
    log.error("refused RQ job %s without importing anything outside the allowed modules: %s", job_id, message)
    raise NotAllowed(message)
