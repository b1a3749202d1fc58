"""The exception tree every hybridq error belongs to.

::

    HybridqError
    ├── JournalError
    │   ├── JournalPathError        the journal path is unusable (not a directory, a symlink, ...)
    │   ├── JournalIOError          a write or fsync failed; *not* acknowledged, outcome unknown
    │   ├── JournalCorruption       damage the journal refuses to repair silently
    │   ├── RecordTooLarge (ValueError)  a payload over ``MAX_PAYLOAD_BYTES``; nothing was written
    │   ├── RecordPunched (FileNotFoundError)  a record read by location was punched: its job finished
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
    │   ├── RetryLaterExpired       a job still saying RetryLater at its deadline: failed for good
    │   └── UnexpectedCancel        an async task's CancelledError nobody asked for (hybridq.worker.values)
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

Each class is defined in a private module of this package, one per role (``_journal``,
``_service``: enqueueing, the transport, settings; ``_tasks``: workers, tasks and waiting for a
job; ``_remote``: ``hybridq serve`` and the remote queue), only to keep each module short, and is
shown, pickled (the classes; an instance pickles as it did before the split) and documented as
``hybridq.errors.<Name>``: the path users catch and pickles hold. The cost: ``inspect.getsource``
finds no source for them (it looks in this file). A module-level limit a class reads
(``RETRY_LATER_MAX_S``, ``RETRY_LATER_MAX_DEADLINE_S``) is re-exported here but read in
``_tasks``: patch it there. Each class is also re-exported by the module named beside it above,
where it used to live.
Only private control-flow signals that never leave their module (``_Refused``) and a chaos
task's own failure (``PlannedFailure``: it stands for a user task's exception) are not hybridq
errors; ``tests/unit/test_errors_tree.py`` pins every other exception class of the package, at
module level or not, to this tree.

Errors carry their data as attributes (path, offset, sequence range), not only in the message.
This package imports nothing else from hybridq, so every layer may import it.
"""

from __future__ import annotations

from ._base import HybridqError
from ._journal import (
    FileOpError,
    HeaderError,
    JournalClosed,
    JournalCorruption,
    JournalError,
    JournalIOError,
    JournalLocked,
    JournalPathError,
    RecordPunched,
    RecordTooLarge,
    SealError,
    StateFileCorrupt,
)
from ._remote import (
    BadRequest,
    BodyTimeout,
    BodyTooLarge,
    Forbidden,
    KeyReused,
    NodeDown,
    NodeUnavailable,
    OutcomeUnknown,
    TokensError,
)
from ._service import (
    ConfigError,
    CronError,
    EnvelopeError,
    InvalidRedisURL,
    JobNotFailed,
    MissingExtra,
    NotSerializable,
    QueueFull,
    RedisFull,
    RedisRefused,
    RedisServerFailed,
    RedisServerNotFound,
    ScheduleError,
    SignatureError,
    SigningKeyError,
    Stopped,
    TransportError,
    UnencodableJobs,
    ValueRefused,
)
from ._tasks import RETRY_LATER_DEADLINE_S as RETRY_LATER_DEADLINE_S
from ._tasks import RETRY_LATER_MAX_DEADLINE_S as RETRY_LATER_MAX_DEADLINE_S
from ._tasks import RETRY_LATER_MAX_S as RETRY_LATER_MAX_S
from ._tasks import RETRY_LATER_MAX_TIMES as RETRY_LATER_MAX_TIMES
from ._tasks import (
    Cancelled,
    DuplicateOfFailedJob,
    JobFailed,
    JobWaitTimeout,
    NoSuchTask,
    NotAllowed,
    ResultNotKept,
    RetryLater,
    RetryLaterExpired,
    StaleDelivery,
    TaskUnavailable,
    UnexpectedCancel,
)

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
    "RecordPunched",
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
    "UnexpectedCancel",
    "ValueRefused",
]


# A class's ``__module__`` is where pickle, tracebacks' "hybridq.errors.JournalIOError: ..." line,
# RQ's failed registry and the docs find it: the public path, as when every class was defined in
# this one module (pickles made before the split name it, and older code must read new ones).
for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
