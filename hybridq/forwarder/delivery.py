"""The forwarder's delivery side: journal records in, batches pushed, the checkpoint moved after.

One step of :class:`~hybridq.forwarder.loop.Forwarder` first forwards: held delayed jobs whose time has
come (:meth:`DeliveryMixin._forward_due`), then the new records (:meth:`DeliveryMixin._forward_new`):
each is decoded, admitted (enqueue-if-absent: :mod:`hybridq.forwarder.admission`), held when it is due
later, or put in the batch; a full batch is pushed and only then does the checkpoint move past its
records (invariant 5: a crash in between re-pushes at most that batch).

These are the forwarder's own methods, kept in a mixin so that they work on its attributes as
they did in :mod:`hybridq.forwarder.loop`: ``_push`` and ``_save`` stay there (tests replace them on
the forwarder), ``_fire_between`` is in :mod:`hybridq.forwarder.wait`. The step that calls them,
in order, is :meth:`hybridq.forwarder.loop.Forwarder.step`.

This module must not import redis or rq (the transport port only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hybridq.envelope.model import Envelope
from hybridq.forwarder.admission import Admission
from hybridq.forwarder.config import ForwarderConfig
from hybridq.forwarder.records import decode_job, read_held
from hybridq.forwarder.state import ForwarderState
from hybridq.journal import JournalReader, Record
from hybridq.ledger.checkpoint import Checkpoint, Held
from hybridq.lookup.index import LookupIndex
from hybridq.protocol import Overwrite
from hybridq.transport.base import Delivery

__all__ = ["DeliveryMixin"]


class DeliveryMixin:
    """Reading the journal, admission, holding delayed jobs, delivering a batch (see module docstring)."""

    # The forwarder's, set in Forwarder.__init__.
    state: ForwarderState
    config: ForwarderConfig
    clock: Callable[[], float]
    admission: Admission
    lookup: LookupIndex
    _reader: JournalReader
    _stopping: bool

    if TYPE_CHECKING:  # the forwarder's own (hybridq.forwarder.loop, hybridq.forwarder.wait)

        @property
        def checkpoint(self) -> Checkpoint:
            """Where forwarding stands."""

        def _push(self, batch: list[Delivery]) -> None:
            """Push a batch (backoff while the transport is down)."""

        def _save(self, forwarded: int) -> None:
            """Save the checkpoint."""

        def _fire_between(self) -> None:
            """Journal due ticks during a long step."""

    def _forward_new(self) -> int:
        reader = self._reader
        try:
            return self._read_and_deliver(reader)
        except BaseException:
            # The reader has moved past records whose batch was not delivered (a full disk while
            # recording an invalid record, a failed save, a stop): read them again next time.
            # Everything before the checkpoint's positions is pushed already.
            reader.seek(self.checkpoint.positions)
            self.admission.reset()
            self.state.pending.rewind(self.checkpoint.positions)
            raise

    def _read_and_deliver(self, reader: JournalReader) -> int:
        done = 0
        batch: list[Delivery] = []
        for record in reader.records():
            loc = (record.writer_id, record.segment_index, record.offset)
            if self.state.index.is_terminal(loc) or loc in self.state.index.duplicates:
                # Finished already (a checkpoint lost or older than the ledger), or an invalid
                # record recorded before a step was retried: never counted twice. A duplicate
                # waits for its key's owner, never pushed.
                self.state.saw(record, None)
                continue
            env = decode_job(self.state, record)
            self.state.saw(record, env)
            if env is None:
                continue
            self.lookup.note_job(record, env)
            if not self.admission.admit(env, loc):
                pass  # a duplicate: recorded, never pushed
            elif env.run_at is not None and env.run_at > self.clock():
                self._hold(env, record)
            else:
                batch.append(self._delivery(env, loc))
            if max(len(batch), self.admission.waiting) >= self.config.batch_size:
                done += self._deliver(batch)
                batch = []
                done += self._forward_due()  # a long backlog must not hold back due jobs
                self._fire_between()  # nor a schedule's tick
                if self._stopping:
                    return done  # SIGTERM: the batch in flight is delivered and checkpointed
        if batch or self._position_moved() or self.admission.waiting:
            done += self._deliver(batch)
        return done

    def _position_moved(self) -> bool:
        return self._reader.position != self.checkpoint.positions

    def _hold(self, env: Envelope, record: Record) -> None:
        assert env.run_at is not None
        self.state.hold(Held(env.run_at, env.id, record.writer_id, record.segment_index, record.offset))

    def _forward_due(self) -> int:
        """Push held jobs whose time has come, then drop them from the checkpoint."""
        now = self.clock()
        held = self.checkpoint.held
        due = 0
        while due < len(held) and held[due].run_at <= now:
            due += 1
        if not due:
            return 0
        done = 0
        batch_size = self.config.batch_size
        for start in range(0, due, batch_size):
            chunk = held[start : min(due, start + batch_size)]
            index = self.state.index
            envs = [
                (
                    h,
                    None
                    if index.is_terminal((h.writer_id, h.segment, h.offset))
                    else read_held(self.state, h),
                )
                for h in chunk
            ]
            self._push(
                [self._delivery(e, (h.writer_id, h.segment, h.offset)) for h, e in envs if e is not None]
            )
            done += len(chunk)
        # Only now that Redis has them may they leave the durable checkpoint.
        self.state.release_held(due)
        self._save(done)
        return done

    def _deliver(self, batch: list[Delivery]) -> int:
        """Push a batch, then move the checkpoint to the reader's position (never before)."""
        # The admission's entries are durable before the checkpoint moves past their records.
        self.admission.flush()
        if batch:
            self._push(batch)
        self.state.advance(self._reader.position)
        self._save(len(batch))
        return len(batch)

    def _delivery(self, env: Envelope, loc: tuple[str, int, int]) -> Delivery:
        # A requeued job replaces its failed predecessor in RQ (same job id, a later run).
        overwrite = Overwrite.EARLIER if env.requeue > 0 else Overwrite.NEVER
        return self.state.delivery(env, loc, 1, overwrite=overwrite)
