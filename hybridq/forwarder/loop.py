"""The forwarder: tails the journal and pushes jobs into the transport, one per journal directory.

Loop: read new records (streaming, bounded memory) -> hold delayed jobs -> push a batch -> save
the checkpoint -> then the completions side (:mod:`hybridq.forwarder.maintain`): harvest outcomes
into the ledger, deliver due retries, check the epoch, reconcile, compact. Everything it
keeps on disk goes through its one :class:`~hybridq.forwarder.state.ForwarderState`; its options
are one frozen :class:`~hybridq.forwarder.config.ForwarderConfig`.
The checkpoint is saved only after the transport accepted the batch
(invariant 5), so a crash in between re-pushes at most that batch, and the deterministic job id
absorbs it. While the transport is down, the forwarder backs off (exponential, with jitter),
logs once when it goes down and once when it comes back, and keeps nothing in memory beyond the
current batch: the backlog stays on disk.

This module keeps the loop (:meth:`Forwarder.run`, :meth:`Forwarder.step` and its order) and
the completions side's timers; the life cycle (recovery, open, close, and open again after a
full disk under the key table) is its base, :class:`~hybridq.forwarder.lifecycle.LifeCycle`.
It holds the parts it calls, built in ``__init__`` (and again by a reopen): the step's
delivery side (journal, admission, delayed jobs, batches:
:class:`~hybridq.forwarder.delivery.Deliverer`), the loop's waits and wakes
(:class:`~hybridq.forwarder.wait.Waits`), the completions side
(:class:`~hybridq.forwarder.upkeep.Upkeep`), cancellation, the lookup index and when it catches
up (:class:`~hybridq.forwarder.lookup_feed.LookupFeed`), the journal directory held and locked
(:class:`~hybridq.forwarder.dirlock.DirLock`) and, in :meth:`Forwarder.run`, the pause on a full
disk (:class:`~hybridq.forwarder.disk_full.DiskFullPause`).

This module must not import redis or rq (only :mod:`hybridq.transport.rq` does).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from hybridq.errors import JournalIOError, Stopped
from hybridq.forwarder.admission import Admission
from hybridq.forwarder.backlog import Backlog
from hybridq.forwarder.cancelling import Canceller
from hybridq.forwarder.config import ForwarderConfig
from hybridq.forwarder.delivery import Deliverer
from hybridq.forwarder.dirlock import DirLock
from hybridq.forwarder.disk_full import DISK_FULL, DiskFullPause
from hybridq.forwarder.flows import Flows
from hybridq.forwarder.gcpolicy import fewer_collections
from hybridq.forwarder.keylimits import KeyLimits
from hybridq.forwarder.lifecycle import LifeCycle
from hybridq.forwarder.lookup_feed import LookupFeed
from hybridq.forwarder.maintain import Maintenance, Parts
from hybridq.forwarder.publish import StatsPublisher
from hybridq.forwarder.push import ForwarderStats, Pusher
from hybridq.forwarder.records import envelope_at
from hybridq.forwarder.selector import Lanes, parse_fair_keys
from hybridq.forwarder.state import ForwarderState
from hybridq.forwarder.upkeep import Upkeep
from hybridq.forwarder.wait import Ticks, Waits
from hybridq.journal import ChainPosition, JournalReader
from hybridq.journal.paths import ensure_journal_dir
from hybridq.ledger.checkpoint import (  # LOCK_NAME: the forwarder's lock file, kept importable here
    LOCK_NAME,
    Checkpoint,
)
from hybridq.ledger.entries import Entry
from hybridq.ledger.sqlite_errors import full_disk_errno
from hybridq.lookup.index import LookupIndex
from hybridq.transport import Transport
from hybridq.transport.base import Delivery

__all__ = ["LOCK_NAME", "Forwarder", "ForwarderConfig", "ForwarderStats", "Ticks"]

log = logging.getLogger("hybridq.forwarder")


class Forwarder(LifeCycle):
    """Forwards one journal directory into a transport.

    The loop and the life cycle are here; it holds the parts it calls: :attr:`delivery` (journal
    records to batches), :attr:`waits` (the idle wait and its wakes), :attr:`completions`
    (harvest, reconcile, compaction), :attr:`admission`, :attr:`cancels` and :attr:`lookup`.

    Args:
        journal: the journal directory (created 0700 when missing).
        transport: where jobs go.
        config: the options (see :class:`ForwarderConfig`); or give them as keywords instead,
            e.g. ``Forwarder(journal, transport, lease_s=30.0)``.
        schedules: periodic jobs to keep (a ``hybridq.scheduler.Scheduler``): each step first
            appends the ticks due to the journal, under the forwarder's lock.
    """

    def __init__(
        self,
        journal: str | os.PathLike[str],
        transport: Transport,
        config: ForwarderConfig | None = None,
        *,
        schedules: Ticks | None = None,
        **options: Any,
    ) -> None:
        if config is not None and options:
            raise TypeError("give the options either as a ForwarderConfig or as keywords, not both")
        # ConfigError or ValueError before anything is created.
        self.config = config if config is not None else ForwarderConfig(**options)
        lanes = Lanes(parse_fair_keys(self.config.fair_keys))
        # The forwarder may start before any producer has: it creates the directory (0700).
        self.journal = ensure_journal_dir(journal)
        self.transport = transport
        self.clock = self.config.clock
        # A plain flag, not an Event: stop() runs in a signal handler, and Event.set() takes a
        # lock the interrupted main thread may be holding inside Event.wait() (a deadlock).
        self._stopping = False
        self.stats = ForwarderStats()
        self._lanes = lanes
        self._dir_lock = DirLock(self.journal)
        self.schedules = schedules
        self._reopen_due = False
        self._build_noted()

    def _build(self, carried: ForwarderState | None = None) -> None:
        """Make the parts (in ``__init__``, and again when the run opens again: :meth:`_reopen`).

        Everything but the options, the transport, the counters, the schedules and the lock.
        ``carried``: a reopen's old state, whose figures the new one shows until it is loaded.
        """
        lanes, schedules, transport = self._lanes, self.schedules, self.transport
        state = ForwarderState(self.journal, self.config)
        if carried is not None:  # /metrics reads them from now on: never zeros (a counter reset)
            state.on_durable_write = carried.on_durable_write
            state.checkpoint, state.compacted = carried.checkpoint, carried.compacted
            state.index = carried.index
        #: Everything it keeps on disk, and the parts that work on it.
        self.state = state
        self.completions = Upkeep(self.state, transport)
        #: Enqueue-if-absent: a job whose explicit idempotency key is taken is recorded, not pushed.
        self.admission = Admission(self.state)
        #: Cancellation: requests in, jobs settled ``cancelled`` (hybridq.forwarder.cancelling).
        self.cancels = Canceller(self.state, transport)
        #: The idle wait between steps, the backoffs' sleeps, and the nudge socket that wakes them.
        self.waits = Waits(
            self.journal,
            self.config,
            self.state,
            self.completions,
            self.stats,
            schedules,
            clock=self.clock,
            stopping=self._stop_asked,
            publish_at=self._publish_at,
        )
        self._pusher = Pusher(
            transport, self.state, self.stats, sleep=self.waits.sleep, stopping=self._stop_asked
        )
        self._reader = JournalReader(self.journal)
        self.journal_check = None  # made by open()
        #: Jobs by id (hybridq.fetch_job): brought up to date after each step that moved something.
        self.lookup = LookupIndex(self.journal, self.clock)
        self.completions.harvester.on_started = self.lookup.note_started  # job.status "started"
        self.lookup.on_checked = self.waits.wake  # its check's verdict, looked at in the next step
        #: The per-key limits' gate (hybridq.forwarder.keylimits): what each limit key has room for.
        self.key_limits = KeyLimits(self.config.key_limits, transport, self.config.lease_s)
        self.state.limit_figures = self.key_limits.figures if self.config.key_limits else None
        #: The windows in Redis, the memory gate, the jobs waiting on disk (docs/forwarder.md).
        self.backlog = Backlog(
            self.state, transport, lanes=lanes, gate=self.key_limits if self.config.key_limits else None
        )
        self._pusher.on_pushed = self.backlog.gate.sent
        self.completions.reconciler.admit = self.backlog.admit  # jobs Redis lost: no flood
        self.completions.reconciler.sent = self.backlog.sent  # the key gate: what Redis took
        self.completions.reconciler.refill_sent = lambda ds: self.backlog.sent(ds, by_push=False)
        self.completions.harvester.takes_back = lambda: self.key_limits.reads  # refused: wait for room
        #: Workflows and jobs with depends_on, moved on from the ledger (docs/workflows.md).
        self.flows = Flows(self.state, lambda: self.state.runs, lambda loc: envelope_at(self.journal, loc))
        self.completions.reconciler.held = lambda loc: loc in self.flows.held
        self.completions.reconciler.held_record = lambda loc, env: self.flows.holds(env, loc)
        self.state.on_append = self._appended  # outcomes to the lookup index, then to the flows
        #: Journal records in, batches pushed, the checkpoint moved after (_push, _save: late-bound).
        self.delivery = Deliverer(
            self.state,
            self.config,
            self.admission,
            self.lookup,
            self.backlog,
            self._reader,
            self.flows,
            clock=self.clock,
            push=lambda batch: self._push(batch),  # noqa: PLW0108 - late-bound, as said above
            save=lambda forwarded: self._save(forwarded),  # noqa: PLW0108 - the same
            fire_between=self._between_batches,
            stopping=self._stop_asked,
        )
        #: Its figures, published to Redis for ``hybridq status --all`` (display only).
        self.publisher = StatsPublisher(self.state, self.stats, transport, self.config.stats_every_s)
        self._lookup_feed = LookupFeed(self.lookup, self._reader)  # when the index catches up
        self._stepped = False  # whether a step ended (the first push is not held up by a display)
        #: The completions side's turn in each step, and its timers (hybridq.forwarder.maintain).
        self.maintenance = Maintenance(
            Parts(
                self.state,
                self.config,
                transport,
                self.completions,
                self.admission,
                self.key_limits,
                self.backlog,
                self._pusher,
                self._reader,
                push=lambda batch: self._push(batch),  # noqa: PLW0108 - late-bound, as the delivery's
                save=lambda forwarded: self._save(forwarded),  # noqa: PLW0108 - the same
            )
        )
        self.completions.harvester.forgetting = self.maintenance.forgetting

    @property
    def checkpoint(self) -> Checkpoint:
        """Where forwarding stands (read it; :attr:`state` changes and saves it)."""
        return self.state.checkpoint

    @property
    def on_durable_write(self) -> Callable[[float], None] | None:
        """Called with the seconds each durable write took (e.g. a metrics histogram's ``observe``)."""
        return self.state.on_durable_write

    @on_durable_write.setter
    def on_durable_write(self, observe: Callable[[float], None] | None) -> None:
        self.state.on_durable_write = observe

    def stop(self) -> None:
        """Ask :meth:`run` to finish the batch in flight, save the checkpoint and return.

        Safe in a signal handler: it sets a flag and sends one datagram, taking no lock.
        """
        self._stopping = True
        self.waits.wake()  # the loop may be waiting for a nudge (or backing off)

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stopping

    # -- the loop -----------------------------------------------------------------------------

    @fewer_collections()  # the collector's pace while it runs (hybridq.forwarder.gcpolicy)
    def run(self) -> None:
        """Forward until :meth:`stop` is called.

        A full disk pauses it: a checkpoint or ledger write that fails with ENOSPC (or EDQUOT)
        changed nothing durable (the ledger continues in a new segment, completion events stay
        in Redis until the ledger has them, a checkpoint is replaced atomically or not at all),
        so the step is simply tried again, with backoff, until space returns. The pause ends
        at a step that shows room (:meth:`_room`), not at one that wrote nothing on a disk still
        full (e.g. just after a reopen): the next write would meet the full disk again.
        """
        pause = DiskFullPause(lambda seconds: self._sleep(seconds))  # noqa: PLW0108 - late-bound
        while not self._stopping:
            state, writes = self.state, self.state.durable_writes
            try:
                if self._reopen_due:
                    self._reopen()
                self.step()
            except Stopped:
                break
            except (JournalIOError, OSError) as exc:
                keys = self.state.index.keys
                if keys.damaged and exc is keys.error and not self._reopen_due:
                    # Its check found the key table damaged (deleted): open again as a start
                    # does, the whole ledger replayed into a new one (docs/reliability.md).
                    # Once per verdict: a reopen that fails is an error as any other (below).
                    self._reopen_due = True
                    continue
                if exc.errno not in DISK_FULL:
                    raise
                self.stats.disk_full_retries += 1
                # A poisoned key table is not retried on: the run opens again first (_reopen).
                self._reopen_due = self._reopen_due or self.state.index.keys.failed
                pause.wait(exc)
                continue
            # Not after a step that wrote nothing on a disk still full: its next write would
            # fail again, a second "paused" line (a flap).
            if not pause.paused or self._room(state, writes):
                pause.over()
            self._wait()

    def step(self) -> int:
        """Forward everything available now (due delayed jobs, then new records); return the count.

        Then the completions side: harvest outcomes, deliver due retries, reconcile, compact
        (after the new records, so that it never delays a new job's push).
        """
        self._dir_lock.check()  # JournalPathError: stop, never forward
        self.state.index.keys.confirm(wait=False)  # its check's verdict, if in: damage reopens
        if self.journal_check is not None:
            self.journal_check.raise_if_failed()  # bit rot in a sealed segment: stop, loudly
        self.cancels.step()  # before anything is pushed: a cancelled job is not
        if self.schedules is not None:
            self.schedules.fire(self.clock())  # a full disk: retried with the step
        done = self.delivery.forward_due() + self.delivery.forward_new()
        if self.lookup.building:
            # Before the harvest too while the index is on its first read: it takes started
            # events only once fed, and a fast worker claims a job this step pushed at once.
            self._lookup_feed.catch_up()
        if not self._stopping:
            self._lookup_feed.due |= self.maintenance.run()
        if done or self._lookup_feed.due or self.delivery.behind or self._lookup_feed.idle_due:
            # After the journal was read and the ledger written: every entry's job is indexed.
            self._lookup_feed.catch_up()
        ended = self.flows.ended
        self.flows.behind = self.delivery.behind  # no unknown dependency's clock starts meanwhile
        if self.lookup.building:
            # A rebuilt index misses outcomes and results until it has read every file: nothing
            # is concluded from it (a dependency "unknown", a result "not recorded") until then.
            self.flows.dirty = True
        elif self.flows.step():  # after the index caught up: the outcomes it reads are there
            done += self.delivery.forward_new()  # the released steps, pushed in this step
            self._lookup_feed.catch_up()
        elif self.flows.ended != ended:
            self._lookup_feed.catch_up()  # a workflow's end: its anchor's outcome, for job.wait()
        self.state.refresh_snapshot()  # outcomes recorded or segments compacted without a save
        if self.state.index.keys.error is not None:  # e.g. its mark failed in a save of the index
            raise self.state.index.keys.error  # run(): a full disk pauses, anything else stops
        self.publisher.maybe_publish()
        if not self._stepped and self.journal_check is not None:
            self.journal_check.start()  # after the first push: the first job does not wait for it
        self._stepped = True
        return done

    # -- pieces -------------------------------------------------------------------------------

    def _wait(self) -> None:
        if self.delivery.behind or self.backlog.more or self.flows.busy or not self.state.pending_ready:
            return  # records to index or count, waiting jobs the windows have room for, news for the flows
        self.waits.wait()

    def _room(self, state: ForwarderState, writes: int) -> bool:
        """Whether a step of a pause shows room: it wrote durably, or (none) a probe finds room."""
        if self.state is state and state.durable_writes != writes:
            return True
        return full_disk_errno(self.journal) is None  # PROBE_BYTES allocated and freed

    def _sleep(self, seconds: float) -> None:
        self.waits.sleep(seconds)

    def _appended(self, entries: Sequence[Entry], chain: str, end: ChainPosition) -> None:
        self.lookup.note_entries(entries, chain, end)
        self.flows.noted(entries)

    def _between_batches(self) -> None:
        """Between two batches of a long step: due ticks, and the stats snapshot if it is due."""
        self.waits.fire_between()
        if self._stepped:  # not before the first push: its first count reads the unread journal
            self.publisher.maybe_publish()

    def _publish_at(self) -> float | None:
        """When the terminal count or the stats snapshot is due (``time.monotonic()``), if either is."""
        due = (self.maintenance.publish_at(), self.publisher.due_at())
        return min((t for t in due if t is not None), default=None)

    def _save(self, forwarded: int) -> None:
        self.state.save(forwarded)

    def _push(self, batch: list[Delivery]) -> list[Delivery]:
        return self._pusher.push(batch)

    def _stop_asked(self) -> bool:
        return self._stopping
