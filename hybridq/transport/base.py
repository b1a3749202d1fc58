"""The transport port: what the forwarder needs from a queue backend, and nothing more."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

# The messages and enums of the wire live in hybridq.protocol; re-exported here, where the
# transport port always named them.
from hybridq.errors import TransportError
from hybridq.protocol import Delivery, Loc, Verdict

__all__ = [
    "MAX_STATS_BODY",
    "Delivery",
    "Event",
    "Finished",
    "KeyUse",
    "Loc",
    "MemoryInfo",
    "Probe",
    "Published",
    "PushResult",
    "RefillResult",
    "StateToken",
    "Transport",
    "Verdict",
]


@dataclass(frozen=True, slots=True)
class PushResult:
    """What one :meth:`Transport.push` did."""

    #: Jobs now queued that were not known to the backend before.
    pushed: int
    #: Jobs the backend already knew (same job id): not queued a second time.
    already_present: int
    #: Bytes of job data sent (0: not counted); the memory gate learns a job's size from it.
    sent_bytes: int = 0
    #: The ids of the jobs queued (new copies: what the key gate counts on their limit keys);
    #: ``None``: the transport does not say (every job taken as queued).
    queued: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class RefillResult:
    """What one :meth:`Transport.refill` did."""

    #: Unfinished jobs queued again, or whose queued copy was rewritten under the new generation.
    requeued: int
    #: Queued copies of finished jobs deleted.
    purged: int
    #: The ids of the unfinished jobs queued anew (missing, or refused as stale): new copies,
    #: which the key gate counts on their limit keys (a copy rewritten in place is counted).
    queued: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Probe:
    """A forwarded job whose state in the backend the forwarder wants to know."""

    job_id: str
    key_id: str
    queue: str
    #: The limit key whose queued count its copies are on ("" none: no policy for its key), for
    #: :meth:`Transport.cancel` (a copy it takes off its queue comes off that count).
    limit_key: str = ""


@dataclass(frozen=True, slots=True)
class StateToken:
    """What identifies the backend's current state: the forwarder's epoch and the server run."""

    epoch: str | None
    run_id: str


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """What Redis says of its memory (``INFO memory``): the forwarder's high-water mark reads it."""

    #: Bytes in use (``used_memory``).
    used: int
    #: The limit (``maxmemory``); 0: none.
    maxmemory: int
    #: What Redis does at the limit (``maxmemory_policy``: ``noeviction``, ``allkeys-lru``...).
    policy: str


@dataclass(frozen=True, slots=True)
class Finished:
    """A job the ledger now holds as terminal (or retrying): what Redis may forget of it."""

    job_id: str
    key_id: str
    queue: str
    #: Whether its idempotency key is its own id (nobody else's dedup depends on the outcome).
    implicit_key: bool


@dataclass(slots=True, unsafe_hash=True)
class Event:
    """One completion event (``hybridq.protocol.CompletionEvent``), or ``body=None`` if garbled.

    Treat it as immutable; hashed as a frozen one. Not ``frozen``: a frozen dataclass's
    ``__init__`` sets each field through ``object.__setattr__``, and the harvest makes one per
    event (docs/benchmarks.md, "The forwarder's decoding per job").
    """

    event_id: str
    body: Mapping[str, Any] | None
    #: Why a claim refused the run whose started event ``body`` is (its limit key had no room:
    #: ``"limited: ..."``); ``None``: not a refusal. The claim script adds the run's signed
    #: started event with this field (``hybridq.worker.scripts``): the forwarder takes the job
    #: back into its run table at once (``hybridq.forwarder.refusals``).
    refused: str | None = None


#: A stats snapshot larger than this is not read (a forwarder's is well under 4 KiB plus its queues).
MAX_STATS_BODY = 64 * 1024


@dataclass(frozen=True, slots=True)
class Published:
    """One forwarder's stats snapshot as Redis holds it (``hybridq status --all``).

    Display only: anyone who can write to Redis can write one (docs/security.md).
    """

    owner: str
    #: When it last published, by its own clock (unix seconds; the sorted set's score).
    last_seen: float
    #: The snapshot (JSON), ``None`` once it expired: the forwarder has not published for its TTL.
    body: bytes | None
    #: Seconds the snapshot has left before it expires (by Redis's clock), ``None`` with no body.
    ttl_left_s: float | None
    #: Why the entry cannot be read (a key of another type, too large): listed as invalid.
    error: str | None = None


class KeyUse(NamedTuple):
    """One limit key's use now, as Redis holds it.

    A named tuple, not a frozen dataclass: the forwarders' read makes one per key read (each
    key once or twice with a key per tenant), and a frozen dataclass sets each field through
    ``object.__setattr__`` (docs/benchmarks.md, "The limits' Python per job"). Read its fields
    by name: that it also unpacks and equals a plain tuple is not promised.
    """

    #: Runs holding a slot (their lease not lapsed).
    running: int
    #: Jobs pushed that no claim took yet (as the forwarders counted them).
    queued: int
    #: Starts within the last rate period (0 without a rate).
    started: int
    #: How long the quarantine after a loss of Redis's state has left (seconds; 0: none).
    quarantine_s: float


class Transport(abc.ABC):
    """Delivers jobs to workers and brings their outcomes back.

    Contract (checked by the shared contract tests):

    * :meth:`push` is idempotent per job id: a job the backend still knows is never queued twice,
      unless the delivery's ``overwrite`` says otherwise (then the old copy is replaced, not
      added to).
    * It either returns (every job in the batch is then known to the backend, so the caller may
      move its checkpoint past them) or raises :class:`~hybridq.errors.TransportError` (any subset
      may have been queued; the caller pushes the whole batch again).
    * Within one queue, jobs of one batch are queued in batch order.
    * Every method raises :class:`~hybridq.errors.TransportError` when the backend is unreachable.
    """

    #: Whether :meth:`publish_stats` puts a snapshot anywhere (``hybridq status --all``): the
    #: forwarder wakes to publish only then.
    publishes_stats = False
    #: Whether :meth:`push` adds the copies it queues of limited jobs (a delivery's ``limit``) to
    #: their keys' queued counts itself, in the same step: then the forwarder's gate adds only
    #: what other paths queue (:meth:`refill`) through :meth:`key_use`.
    counts_limited_pushes = False

    @abc.abstractmethod
    def push(self, jobs: Sequence[Delivery]) -> PushResult:
        """Queue ``jobs`` for the workers; see the class docstring for the contract."""

    @abc.abstractmethod
    def ping(self) -> None:
        """Raise :class:`~hybridq.errors.TransportError` unless the backend answers."""

    def refill(self, terminal: Sequence[Probe], live: Sequence[Delivery]) -> RefillResult:  # noqa: ARG002
        """After the epoch changed: purge ``terminal`` jobs' queued copies, bring ``live`` ones up.

        ``terminal``: jobs the ledger holds as finished; a copy of one still *queued* (Redis
        brought it back from an older state) is deleted, hash and queue entry. ``live``: the
        unfinished jobs, each as a delivery under the new generation: queued again if missing or
        refused by a worker as stale, its queued copy rewritten in place if it has one (so it keeps
        its place in the queue), left alone if a worker runs or ran it (the reconcile pass sees to
        those).

        The default only pushes ``live`` (a transport without epoch fencing).
        """
        return RefillResult(self.push(live).pushed, 0)

    def evict(self, terminal: Sequence[Probe], live: Sequence[Delivery]) -> tuple[int, set[str]]:  # noqa: ARG002
        """Remove copies of jobs whose queue now lives on another backend (the map changed).

        Called by a refill of several backends (:mod:`hybridq.transport.sharded`) with the jobs
        of queues that do not live here. Each copy is deleted, hash and queue entry, unless a
        worker runs it here (holds its lease) or stored the outcome of the run in ``live`` here.

        Returns:
            The number of copies deleted, and the ids of ``live`` jobs that run or ran here
            (not to be delivered elsewhere: their completion events come from here).
            The default (one backend: nothing moves) does nothing.
        """
        return 0, set()

    #: How long RQ keeps the result of a job that does not ask for a ``result_ttl`` (seconds);
    #: ``None``: RQ's own default. The forwarder sets 0 when finished jobs leave Redis at their
    #: harvest (docs/forwarder.md, "What Redis holds"): the worker then deletes them at the end.
    default_result_ttl_s: float | None = None

    #: Whether :meth:`wait_events` blocks until an event arrives (else the forwarder polls).
    blocking_events: bool = False

    def wait_events(self, owner: str, after: str, timeout_s: float) -> bool:  # noqa: ARG002
        """Wait up to ``timeout_s`` for an event of ``owner`` newer than ``after``; whether one is there.

        The default waits for nothing (see :attr:`blocking_events`).
        """
        return False

    @abc.abstractmethod
    def harvest(self, owner: str, limit: int) -> list[Event]:
        """Up to ``limit`` of the oldest completion events for ``owner`` (not removed)."""

    @abc.abstractmethod
    def ack(self, owner: str, event_ids: Sequence[str]) -> None:
        """Delete harvested events (only after they are durable in the ledger)."""

    @abc.abstractmethod
    def state_token(self, owner: str) -> StateToken:
        """The epoch ``owner`` last set, and the backend's run id (changes on every restart)."""

    @abc.abstractmethod
    def set_epoch(self, owner: str, epoch: str) -> None:
        """Store ``owner``'s epoch token."""

    @abc.abstractmethod
    def probe(self, jobs: Sequence[Probe], *, lease_s: float) -> list[Verdict]:
        """Per job, what the backend knows.

        ``missing``: the backend does not have it. ``queued``: waiting for a worker. ``running``:
        a worker holds its lease (or it changed state less than ``lease_s`` ago). ``done``: its
        outcome is stored and its completion event awaits harvest. ``orphaned``: a worker claimed
        it (the task started) and no longer holds the lease, and there is no outcome (the worker
        or its work-horse died): deliver the next attempt. ``stranded``: no worker will ever run
        it, and it never started: it says "queued" but its queue is gone (evicted), or a worker
        took it and died before the task started.
        """

    def cancel(self, jobs: Sequence[Probe], *, key_ttl_s: float) -> list[bool]:  # noqa: ARG002
        """Mark ``jobs`` cancelled, take them off their queues; per job, whether a worker runs it.

        A worker that takes a marked job finds the mark at its claim and runs nothing; one that
        runs it sees the mark and stops it (docs/worker.md). The mark lasts ``key_ttl_s``.
        ``True``: a worker holds the job's lease (ask again later); ``False``: none does, and
        none will run it. The default cannot cancel: it raises (the forwarder keeps asking).
        """
        raise TransportError(f"{type(self).__name__} cannot cancel jobs")

    def publish_stats(self, owner: str, body: bytes, ttl_s: float) -> None:  # noqa: B027
        """Publish ``owner``'s stats snapshot for ``ttl_s`` seconds (``hybridq status --all``).

        The default publishes nowhere (a transport without a shared place to put it).
        """

    def read_stats(self, limit: int) -> list[Published]:  # noqa: ARG002
        """Every published stats snapshot, the most recently seen first, at most ``limit``."""
        return []

    def forget_stats(self, owner: str) -> bool:  # noqa: ARG002
        """Remove ``owner``'s snapshot and its entry (a forwarder removed for good); False if absent."""
        return False

    def memory(self) -> MemoryInfo | None:
        """The backend's memory use and limit (the fullest Redis of several); ``None``: unknown.

        The default knows nothing: the forwarder's high-water mark is then off.
        """
        return None

    def queue_lengths(self, queues: Sequence[str]) -> dict[str, int] | None:  # noqa: ARG002
        """How many jobs wait in each queue now (``LLEN``); ``None``: the backend cannot say.

        The forwarder's window (docs/forwarder.md) sizes what it keeps in the backend from these;
        the default (``None``) leaves the window open: every job is pushed as it is read.
        """
        return None

    def key_use(
        self,
        periods: Mapping[str, int],  # noqa: ARG002
        added: Mapping[str, int],  # noqa: ARG002
        *,
        lease_s: float,  # noqa: ARG002
    ) -> dict[str, KeyUse] | None:
        """Per limit key of ``periods`` (key -> rate period, ms) its use now; ``None``: unknown.

        First adds ``added`` (key -> jobs pushed since the last call) to the keys' queued counts.
        The forwarder's gate (``hybridq.forwarder.keylimits``) pushes no more than the room this
        leaves; the default (``None``) leaves every key open: the workers' claims alone enforce
        the limits (docs/forwarder.md, "Limits per key").
        """
        return None

    def drop_finished(self, jobs: Sequence[Finished], *, result_ttl_s: float) -> None:  # noqa: ARG002
        """Delete what the backend keeps of jobs the ledger holds now (their hash, RQ's result).

        Called after the harvest made them durable (docs/forwarder.md, "What Redis holds"): an
        implicit key's stored outcome is kept ``result_ttl_s`` more (a second delivery waiting
        on the lease reads it), an explicit key's keeps its own lifetime. The default keeps all.
        """
        return

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release connections."""
