"""The forwarder's scheduler: journals each due tick of its schedules as a job (docs/schedules.md).

The forwarder calls :meth:`Scheduler.fire` from its loop (it holds the journal's forwarder lock,
so one scheduler at a time keeps a journal's schedules). A tick is appended like any
``enqueue`` (fsync'd, signed when a key is configured) with the idempotency key
``schedule:<key>:<fire time>``; then the scheduler records, in ``schedules.state`` in the
journal directory, that every tick up to now is decided. So:

* a crash after the append and before that record appends the tick again on restart: the same
  key, so the forwarder records it as a duplicate and never pushes it (enqueue-if-absent,
  :mod:`hybridq.forwarder.admission`);
* a crash before the append loses nothing: the tick is still due, and the catch-up policy
  fires it;
* a tick in the journal is a job like any other: pushed again if Redis loses it, never run
  again once the ledger has it finished (docs/guarantees.md).

This module must not import redis or rq. The forwarder does not import it (producer and
forwarder are separate roles): ``hybridq forward`` builds it and hands it to the forwarder.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridq import crashpoints
from hybridq.envelope.model import Envelope
from hybridq.errors import StateFileCorrupt
from hybridq.journal import JournalWriter
from hybridq.journal.statefile import read_state, write_state
from hybridq.producer.queue import Queue
from hybridq.schedules import Schedule, ScheduleError, fire_time_iso, tick_key

__all__ = ["STATE_NAME", "Scheduler", "TickState", "load_ticks", "save_ticks"]

log = logging.getLogger("hybridq.schedules")

#: The scheduler's state file in the journal directory (``schedules.state``).
STATE_NAME = "schedules"
#: The segment size of the ticks' own journal chain. A segment is compacted only once sealed,
#: and the forwarder keeps the keys of a segment's jobs in memory while it is on disk: ticks
#: trickle in, so a producer's 64 MiB would hold ~150,000 of them (~75 MB of keys) for months.
TICK_SEGMENT_BYTES = 1 << 20


@dataclass
class TickState:
    """Where one schedule stands: every tick up to ``through`` is decided (fired or skipped)."""

    through: float
    #: The last tick fired (its fire time), ``None`` before the first.
    last: float | None = None
    #: Ticks fired since the schedule began.
    fired: int = 0


def load_ticks(journal: str) -> dict[str, TickState]:
    """The saved state of each schedule of ``journal`` (empty when there is none yet)."""
    raw = read_state(journal, STATE_NAME)
    if raw is None:
        return {}
    try:
        body = json.loads(raw)
        return {
            str(key): TickState(
                float(v["through"]),
                None if v.get("last") is None else float(v["last"]),
                int(v.get("fired", 0)),
            )
            for key, v in body["schedules"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StateFileCorrupt(os.path.join(journal, STATE_NAME + ".state"), f"malformed: {exc!r}") from exc


def save_ticks(journal: str, ticks: dict[str, TickState]) -> None:
    """Durably replace the state (temp file, fsync, rename, directory fsync)."""
    body: dict[str, Any] = {
        "v": 1,
        "schedules": {
            key: {"through": t.through, "last": t.last, "fired": t.fired} for key, t in sorted(ticks.items())
        },
    }
    write_state(journal, STATE_NAME, json.dumps(body, separators=(",", ":")).encode())


class Scheduler:
    """Fires the ticks of ``schedules`` into ``journal`` (the forwarder's ``schedules=`` hook).

    Args:
        journal: the forwarder's journal directory.
        schedules: what to keep (``hybridq.schedules.load_schedules``); keys must be distinct.
        save: how the state is saved (replaced in tests to simulate a crash).

    Raises:
        ScheduleError: a schedule whose job options ``Queue.prepare`` refuses (checked now).
    """

    def __init__(
        self,
        journal: str | os.PathLike[str],
        schedules: Sequence[Schedule],
        *,
        save: Callable[[str, dict[str, TickState]], None] = save_ticks,
    ) -> None:
        self.schedules = list(schedules)
        keys = [s.key for s in self.schedules]
        if len(set(keys)) != len(keys):
            raise ValueError("schedule keys must be distinct")
        self._queues = {s.queue: Queue(s.queue, journal) for s in self.schedules}
        self.journal = next(iter(self._queues.values())).journal if self._queues else os.fspath(journal)
        for s in self.schedules:
            try:  # the options, as an enqueue would check them: now, not at a tick
                self._prepare(s, 0.0)
            except (TypeError, ValueError) as exc:
                raise ScheduleError(f"schedule {s.key!r}: {exc}") from None
        self._save = save
        self._ticks: dict[str, TickState] | None = None
        self._next: dict[str, float] = {}
        self._writer: JournalWriter | None = None

    def close(self) -> None:
        """Seal the ticks' journal chain (the forwarder's ``close`` does). Idempotent."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    @property
    def ticks(self) -> dict[str, TickState]:
        """Each schedule's state (loaded by the first :meth:`fire`)."""
        return dict(self._ticks or {})

    def next_fire(self) -> float | None:
        """When the soonest tick is due (Unix time); ``None`` before the first :meth:`fire`."""
        return min(self._next.values(), default=None)

    def fire(self, now: float) -> int:
        """Append the jobs of the ticks due at ``now`` (one fsync), then record it; return how many.

        The first call loads the state (the forwarder's lock must be held): a schedule seen for
        the first time starts at ``now`` (its past is not caught up).
        """
        if self._ticks is None:
            self._load(now)
        assert self._ticks is not None
        if not self._next or now < min(self._next.values()):
            return 0
        envelopes: list[Envelope] = []
        moved: dict[str, TickState] = {}
        for s in self.schedules:
            if now < self._next[s.key]:
                continue
            state = self._ticks[s.key]
            due, skipped = s.due(state.through, now)
            if skipped:
                log.warning(
                    "schedule %s: skipping missed ticks before %s (catchup=%s%s)",
                    s.key,
                    fire_time_iso(due[0]) if due else fire_time_iso(now),
                    s.catchup,
                    f", max_catchup={s.max_catchup}" if s.catchup == "all" else "",
                )
            envelopes.extend(self._prepare(s, fire) for fire in due)
            moved[s.key] = TickState(
                through=max(state.through, now),
                last=due[-1] if due else state.last,
                fired=state.fired + len(due),
            )
        if envelopes:
            # Durable first: a crash before the state is saved appends the same keys again,
            # which the forwarder records as duplicates (never pushed).
            queue = next(iter(self._queues.values()))
            if self._writer is None or self._writer.closed:
                self._writer = JournalWriter(self.journal, max_segment_bytes=TICK_SEGMENT_BYTES)
            queue._use_writer(self._writer)  # its own chain, not the process's shared ones
            jobs = queue.enqueue_many(envelopes)
            crashpoints.reached("schedule_after_append")
            for job in jobs:
                log.info("schedule tick %s: job %s", job.envelope.idempotency_key, job.id)
        if moved:
            self._save(self.journal, {**self._ticks, **moved})
            self._ticks.update(moved)
            for key, state in moved.items():
                sched = next(s for s in self.schedules if s.key == key)
                self._next[key] = sched.next_fire(state.through)
        return len(envelopes)

    def _load(self, now: float) -> None:
        saved = load_ticks(self.journal)
        ticks = {s.key: saved.get(s.key) or TickState(through=now) for s in self.schedules}
        for key in sorted(set(saved) - set(ticks)):
            log.info("schedule %s is no longer declared: forgotten", key)
        if ticks != saved:
            self._save(self.journal, ticks)  # a new schedule starts now, even after a restart
        self._ticks = ticks
        self._next = {s.key: s.next_fire(ticks[s.key].through) for s in self.schedules}
        for s in self.schedules:
            due = self._next[s.key]
            log.info(
                "schedule %s (%s, %s, catchup=%s): %s %s",
                s.key,
                s.cron.expression,
                s.tz,
                s.catchup,
                "next tick" if due > now else "missed ticks since",
                fire_time_iso(due),
            )

    def _prepare(self, s: Schedule, fire: float) -> Envelope:
        meta = {**dict(s.options.get("meta") or {}), "schedule": s.key, "fire_time": fire_time_iso(fire)}
        options = {k: v for k, v in s.options.items() if k != "meta"}
        return self._queues[s.queue].prepare(
            s.func, s.args, s.kwargs, idempotency_key=tick_key(s.key, fire), meta=meta, **options
        )
