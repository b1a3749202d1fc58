"""The forwarder's delivery side: journal records in, batches pushed, the checkpoint moved after.

One step of :class:`~hybridq.forwarder.loop.Forwarder` first forwards: held delayed jobs whose time has
come (:meth:`Deliverer.forward_due`), then the new records (:meth:`Deliverer.forward_new`): each
is decoded, admitted (enqueue-if-absent: :mod:`hybridq.forwarder.admission`), held when it is due
later, or put in the batch; a full batch is pushed and only then does the checkpoint move past its
records (invariant 5: a crash in between re-pushes at most that batch).

The forwarder holds one :class:`Deliverer` and hands it what it calls: the push and the
checkpoint save stay the loop's (``Forwarder._push`` and ``Forwarder._save``, which tests
replace), the ticks fired during a long step are the loop's waits'
(:meth:`hybridq.forwarder.wait.Waits.fire_between`).

This module must not import redis or rq (the transport port only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from hybridq.envelope.model import Envelope
from hybridq.errors import RedisFull
from hybridq.forwarder.admission import Admission
from hybridq.forwarder.backlog import Backlog
from hybridq.forwarder.config import ForwarderConfig
from hybridq.forwarder.flows import Flows
from hybridq.forwarder.records import HeldReads, decode_job, first_delivery
from hybridq.forwarder.runs import Row, row_of
from hybridq.forwarder.state import ForwarderState
from hybridq.journal import JournalReader, Record
from hybridq.ledger.checkpoint import Checkpoint, Held
from hybridq.lookup.index import LookupIndex
from hybridq.transport.base import Delivery, Loc

__all__ = ["Deliverer"]

#: The most jobs one step indexes into the run table before it harvests and refills (the rest
#: is read at the next step, at once): a long backlog must not hold back the outcomes.
INDEX_BUDGET = 5000


@dataclass(eq=False)
class Deliverer:
    """Reading the journal, admission, holding delayed jobs, delivering a batch (see module docstring)."""

    #: The forwarder's durable state (checkpoint, ledger index, pending jobs).
    state: ForwarderState
    #: The forwarder's options (its batch size).
    config: ForwarderConfig
    #: Enqueue-if-absent, one job per explicit idempotency key.
    admission: Admission
    #: The lookup index, told of each job read.
    lookup: LookupIndex
    #: The windows in Redis and the run table: which jobs are pushed now, which wait on disk.
    backlog: Backlog
    #: The journal reader, positioned at the checkpoint.
    reader: JournalReader
    #: Workflows' anchors and jobs with ``depends_on``: held there, never pushed as read.
    flows: Flows
    _: KW_ONLY
    #: The forwarder's clock (delayed jobs' ``run_at``).
    clock: Callable[[], float]
    #: Pushes a batch into the transport (backing off while it is down).
    push: Callable[[list[Delivery]], list[Delivery]]
    #: Saves the checkpoint, ``forwarded`` jobs more.
    save: Callable[[int], None]
    #: Journals the schedules' ticks due during a long step.
    fire_between: Callable[[], None]
    #: Whether the forwarder was asked to stop.
    stopping: Callable[[], bool]
    #: Whether the last :meth:`forward_new` stopped at its budget with records left to read.
    behind: bool = False
    #: Whether this step read Redis's queue lengths already (:meth:`_split`).
    _looked: bool = field(default=False, init=False)

    @property
    def checkpoint(self) -> Checkpoint:
        """Where forwarding stands."""
        return self.state.checkpoint

    def forward_new(self) -> int:
        """Forward the records appended since the checkpoint; return how many jobs were pushed."""
        reader = self.reader
        try:
            return self._read_and_deliver(reader)
        except BaseException:
            # The reader has moved past records whose batch was not delivered (a full disk while
            # recording an invalid record, a failed save, a stop): read them again next time.
            # Everything before the checkpoint's positions is pushed already.
            reader.seek(self.checkpoint.positions)
            self.admission.reset()
            self.state.runs.rollback()
            self.flows.rollback()
            self.state.pending.rewind(self.checkpoint.positions)
            raise

    def _read_and_deliver(self, reader: JournalReader) -> int:
        done = indexed = 0
        self.behind = False
        ready: list[tuple[Envelope, Loc]] = []
        # Redis's queue lengths and memory are read once a job read may go to Redis (_split),
        # not at every step: most steps of a drain read no new record, and the completions
        # side looks right after (docs/benchmarks.md, "The forwarder's whole step").
        self._looked = False
        self.backlog.begin()
        for record in reader.records():
            loc = (record.writer_id, record.segment_index, record.offset)
            if self.state.index.is_terminal(loc) or loc in self.state.index.duplicates:
                # Finished already (a checkpoint lost or older than the ledger), or an invalid
                # record recorded before a step was retried: never counted twice. A duplicate
                # waits for its key's owner, never pushed.
                self.state.saw(record, None)
                self.lookup.note_record(record)
                continue
            env = decode_job(self.state, record)
            self.state.saw(record, env)
            if env is None:
                self.lookup.note_record(record)  # the index reads no record this reader reads
                continue
            self.lookup.note_job(record, env)
            if loc in self.state.index.cancels:
                pass  # cancelled, not settled while Redis refuses its mark: never pushed
            elif not self.admission.admit(env, loc):
                pass  # a duplicate: recorded, never pushed
            elif self.flows.intercept(env, loc):
                pass  # a workflow, or a job waiting for others: released by the flows (docs/workflows.md)
            elif env.run_at is not None and env.run_at > self.clock():
                self._hold(env, record)
            else:  # pushed now, or waits on disk: decided with its chunk (docs/forwarder.md)
                ready.append((env, loc))
            if max(len(ready), self.admission.waiting) >= self.config.batch_size:
                batch, spill = self._split(ready)
                indexed += len(spill)
                done += self._deliver(batch, spill)
                ready = []
                done += self.forward_due()  # a long backlog must not hold back due jobs
                self.fire_between()  # nor a schedule's tick
                if self.stopping():
                    return done  # SIGTERM: the batch in flight is delivered and checkpointed
                if indexed >= INDEX_BUDGET:
                    self.behind = True  # harvest and refill first; read on at the next step
                    return done
        if ready or self._position_moved() or self.admission.waiting:
            done += self._deliver(*self._split(ready))
        return done

    def _split(self, ready: list[tuple[Envelope, Loc]]) -> tuple[list[Delivery], list[Row]]:
        """Those of ``ready`` (in read order) that go to Redis now, and those that wait on disk.

        The key gate reads the limit keys it never read of the jobs that may go now first, in
        one call: a key's first sight does not send its jobs through the run table.
        """
        if ready and not self._looked:  # with their queues: a new queue's first window sees its length
            self.backlog.look({env.queue for env, _ in ready})
            self._looked = True
        self.backlog.prefetch_read((env.queue, env.limit_key) for env, _ in ready)
        batch: list[Delivery] = []
        spill: list[Row] = []
        for env, loc in ready:
            if self.backlog.take(env.queue, env.limit_key):
                batch.append(self._delivery(env, loc))
            else:
                spill.append(row_of(loc, env))
                self.state.decoded.keep(loc, env)  # for the refill: not read back and decoded again
        return batch, spill

    def _position_moved(self) -> bool:
        return self.reader.position != self.checkpoint.positions

    def _hold(self, env: Envelope, record: Record) -> None:
        assert env.run_at is not None
        self.state.hold(Held(env.run_at, env.id, record.writer_id, record.segment_index, record.offset))

    def forward_due(self) -> int:
        """Move held jobs whose time has come to the run table, then drop them from the checkpoint.

        They wait there behind the jobs that became eligible before them, and the refill pushes
        them through the same window (docs/forwarder.md, "The window"). Returns 0: none is
        pushed here.
        """
        now = self.clock()
        held = self.checkpoint.held
        due = 0
        while due < len(held) and held[due].run_at <= now:
            due += 1
        if not due:
            return 0
        index = self.state.index
        runs = self.state.runs
        with HeldReads(self.state) as reads:
            for h in held[:due]:
                loc = (h.writer_id, h.segment, h.offset)
                env = None if index.is_terminal(loc) else reads.read(h)
                if env is not None:
                    runs.add([row_of(loc, env, h.run_at)])
        # Only now that the run table has them (fsync'd) may they leave the durable checkpoint.
        runs.commit()
        self.state.release_held(due)
        self.save(0)
        return 0

    def _deliver(self, batch: list[Delivery], spill: list[Row]) -> int:
        """Push a batch, index the rest; then move the checkpoint to the reader's position (never before)."""
        # The admission's entries are durable before the checkpoint moves past their records.
        self.admission.flush()
        runs = self.state.runs
        runs.add(spill)
        if batch:
            try:
                accepted = self.push(batch)
            except RedisFull as exc:
                # Waiting for memory must not hold back the harvest that frees it: the batch
                # waits in the run table instead, and the refill pushes it once there is room.
                self.backlog.paused(exc)
                runs.add(
                    (
                        d.loc,
                        d.envelope.queue,
                        d.envelope.created_at,
                        d.envelope.priority,
                        d.envelope.limit_key or "",
                    )
                    for d in batch
                )
                batch = []
            else:
                self.backlog.sent(accepted)  # less what the transport could not encode
                self.state.pushed.add(d.loc for d in accepted)  # what a refill reads back
        self.backlog.begin()  # the key gate counted what went: ask it afresh
        # Indexed before read past (docs/forwarder.md): a crash in between reads them again.
        runs.commit()
        self.flows.commit()
        self.state.advance(self.reader.position)
        self.save(len(batch))
        return len(batch)

    def _delivery(self, env: Envelope, loc: tuple[str, int, int]) -> Delivery:
        return first_delivery(self.state, env, loc)
