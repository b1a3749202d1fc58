"""The backlog: what the forwarder keeps out of Redis, and how it tops the window up.

The forwarder pushes a job as it reads it only while the job's queue has room in its window and
nothing of that queue waits before it; every other job is indexed in the run table
(:mod:`hybridq.forwarder.runs`) and waits there, on disk. :meth:`Backlog.refill` (each step,
after the harvest: outcomes make room) pushes waiting jobs of every queue with room, in the
order :class:`~hybridq.forwarder.selector.Selector` picks them (priority, aging, fair keys),
under the memory gate (:class:`~hybridq.forwarder.window.MemoryGate`). Every push path (the
read-time :meth:`Backlog.take`, :meth:`Backlog.refill`, :meth:`Backlog.admit`) asks the key
gate (:class:`~hybridq.forwarder.selector.KeyGate`, the limits) for a job with a limit key. A push
is tried once: Redis down or full leaves the rows for a later step, and the step goes on to
harvest (docs/forwarder.md, "The window").

This module must not import redis or rq (the transport port only).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from hybridq.envelope.model import Envelope
from hybridq.errors import RedisFull, RedisRefused, TransportError, UnencodableJobs
from hybridq.forwarder.records import HeldReads, row_delivery
from hybridq.forwarder.refusals import moved_on
from hybridq.forwarder.runs import RunTable
from hybridq.forwarder.selector import KeyGate, Lanes, Selector, Unlimited
from hybridq.forwarder.state import ForwarderState
from hybridq.forwarder.window import MemoryGate, Windows
from hybridq.ledger.checkpoint import Held
from hybridq.transport.base import Delivery, Loc, Transport

__all__ = ["Backlog"]

log = logging.getLogger("hybridq.forwarder")

#: Rows read back from the journal per push (one pipeline).
REFILL_CHUNK = 500


class Backlog:
    """The window of every queue, the memory gate and the run table of one forwarder.

    Args:
        state: the forwarder's durable state (the run table is its :attr:`ForwarderState.runs`).
        transport: where jobs go.
        clock: monotonic time (replaced in tests).
        gate: the limits per limit key (default: none).
        lanes: the fair keys (default: none).
    """

    def __init__(
        self,
        state: ForwarderState,
        transport: Transport,
        *,
        clock: Callable[[], float] = time.monotonic,
        gate: KeyGate | None = None,
        lanes: Lanes | None = None,
    ) -> None:
        self.state = state
        self.transport = transport
        self.keys: KeyGate = gate if gate is not None else Unlimited()
        #: Picks the rows each refill pushes (priority, aging, fair keys, the key gate).
        self.selector = Selector(state.runs, self.keys, lanes)
        #: Queues whose last pick found fewer rows than it had room for (the gate held the rest).
        self._short: set[str] = set()
        #: The ids of the jobs the last push queued (``None``: the transport did not say).
        self._queued: frozenset[str] | None = frozenset()
        self.windows = Windows(state.config, clock)
        self.gate = MemoryGate(state.config, clock)
        #: Jobs pushed from the run table since start.
        self.refilled = 0
        #: Whether the last :meth:`refill` left rows it had room for (the loop does not sleep).
        self.more = False
        #: Per queue with waiting jobs: when its oldest became eligible (a Unix time), as of the
        #: last refill (metrics read it from another thread: no query at scrape time).
        self.oldest: dict[str, float] = {}
        state.figures = self.figures
        self._published: dict[str, dict[str, Any]] = {}
        self._publish_at = 0.0

    @property
    def runs(self) -> RunTable:
        """The waiting jobs, on disk."""
        return self.state.runs

    def look(self, queues: Iterable[str] = ()) -> None:
        """Read Redis's memory and the lengths of ``queues`` and every queue with waiting jobs.

        Redis down: the last figures stay (the push that follows fails and says so).
        """
        names = sorted({*queues, *self.runs.counts, *self.windows.queues})
        try:
            self.gate.sample(self.transport)
            self.windows.look(self.transport, names)
        except RedisRefused:
            raise
        except TransportError as exc:
            log.debug("cannot read Redis's queue lengths or memory now: %s", exc)
        detail, _ = self.figures()
        now = time.monotonic()
        if detail != self._published or now >= self._publish_at:  # stats read them: say so
            self._published, self._publish_at = detail, now + 1.0
            self.state.figures_changed()

    def room(self, queue: str) -> int:
        """How many of ``queue``'s jobs may go to Redis now."""
        return min(self.windows.room(queue), self.gate.room())

    def take(self, queue: str, key: str | None = None) -> bool:
        """Whether a job of ``queue`` just read goes straight to Redis (counted if it does).

        Only while nothing of its queue waits on disk: a job read now never overtakes a waiting
        one of higher priority. A job of limit key ``key`` goes only while the key gate has room
        (counted until :meth:`sent` after the batch's push).
        """
        if self.runs.waiting(queue) or self.room(queue) <= 0 or not self.selector.fits(key):
            return False
        self.windows.of(queue).pushed(1)
        self.gate.pushed(1)
        return True

    def prefetch(self, keys: Iterable[str | None]) -> None:
        """The key gate reads, in one call, the keys of jobs about to be decided it never read."""
        self.selector.prefetch(keys)

    def prefetch_read(self, jobs: Iterable[tuple[str, str | None]]) -> None:
        """:meth:`prefetch` for jobs just read (``(queue, limit key)``) that may go straight to Redis.

        As many of each queue as its room, none of a queue with jobs waiting on disk: the others
        go to the run table, and their keys are read with the refill's chunk they are pushed in
        (a key read here too was read twice: with a backlog, about one read more per job).
        """
        rooms: dict[str, int] = {}
        keys = []
        for queue, key in jobs:
            room = rooms.get(queue)
            if room is None:
                room = 0 if self.runs.waiting(queue) else self.room(queue)
            rooms[queue] = room - 1
            if room > 0 and key:
                keys.append(key)
        self.prefetch(keys)

    def begin(self) -> None:
        """A new batch of reads: the key gate is asked again (what :meth:`take` counted is dropped)."""
        self.selector.begin()

    def sent(self, deliveries: Iterable[Delivery], *, by_push: bool = True) -> None:
        """Tell the key gate that ``deliveries`` were queued (by the push; else by the reconcile pass)."""
        keys = Counter(d.envelope.limit_key for d in deliveries if d.envelope.limit_key)
        if keys:
            self.keys.pushed_keys(keys, by_push=by_push)

    def admit(self, deliveries: list[Delivery]) -> list[Delivery]:
        """Those of ``deliveries`` the windows and the key gate have room for now.

        The windows count them as pushed now (a push that fails leaves the job to be found
        again: a window under-used, never over); the key gate is told by :meth:`sent` once the
        transport accepted them, by the caller: a concurrency gate told of a push that never
        happened would keep that room taken for good.

        Retries, and jobs Redis lost (a queue not looked at yet is looked at first: a job a
        lost run table made look lost may be the first this process pushes to its queue).
        """
        unseen = {d.envelope.queue for d in deliveries} - self.windows.queues.keys()
        if unseen:
            self.look(sorted(unseen))
        out: list[Delivery] = []
        self.begin()
        self.prefetch(d.envelope.limit_key for d in deliveries)
        for d in deliveries:
            queue = d.envelope.queue
            if self.room(queue) > 0 and self.selector.fits(d.envelope.limit_key):
                self.windows.of(queue).pushed(1)
                self.gate.pushed(1)
                out.append(d)
        return out

    def paused(self, exc: RedisFull) -> None:
        """A push met ``OOM``: pause pushes (one log line) until the gate sees room."""
        self.gate.refused(exc)

    def refill(self) -> int:
        """Push the oldest waiting jobs of every queue with room; return how many went.

        One try per chunk: a refused push (Redis down or full) leaves its rows, and the step
        goes on (harvesting frees Redis's memory and makes room).
        """
        self.more = False
        self._short.clear()
        self.begin()  # the key gate is asked afresh once per refill
        done = 0
        for queue in sorted(self.runs.counts):
            while self.runs.waiting(queue):
                n = min(self.room(queue), REFILL_CHUNK)
                if n <= 0:
                    break
                pushed = self._push_head(queue, n)
                if pushed is None:
                    return done
                done += pushed
                if queue in self._short:
                    break  # the key gate holds the rest: they wait on disk
        self.more = any(
            self.runs.waiting(q) and self.room(q) > 0 and q not in self._short for q in self.runs.counts
        )
        self.oldest = {q: t for q in list(self.runs.counts) if (t := self.runs.oldest(q)) is not None}
        return done

    def _push_head(self, queue: str, n: int) -> int | None:
        """Push the ``n`` rows of ``queue`` the selector picks; ``None`` if the transport refused them."""
        rows = self.selector.pick(queue, n)
        if len(rows) < n:
            self._short.add(queue)
        index = self.state.index
        read: dict[Loc, Envelope] = {}
        with HeldReads(self.state) as reads:
            # Read in location order, pushed in pick order: a fair pick cycles through its lanes,
            # whose heads may sit in more segments than a HeldReads keeps open (16).
            for loc, order, _, _ in sorted(rows):
                if index.is_terminal(loc) or loc in index.cancels or loc in index.duplicates:
                    continue  # settled while it waited (cancelled, or finished after a lost row delete)
                if moved_on(self.state, loc):
                    continue  # put back by a refusal its run outlived: its retry delivers it (refusals)
                # Most were kept decoded as they were read: taken without the Held and its
                # label a read back needs (about 12,000 instructions a row: docs/benchmarks.md).
                env = self.state.decoded.take(loc)
                if env is None:
                    env = reads.read(Held(order, f"at {loc[0]}:{loc[1]}:{loc[2]}", *loc))
                if env is not None:
                    read[loc] = env
        batch = [row_delivery(self.state, read[row[0]], row[0]) for row in rows if row[0] in read]
        if batch and not self._try_push(batch):
            return None
        # Only now that Redis has them may their rows go (a crash before: pushed again, absorbed).
        self.runs.remove(queue, [row[0] for row in rows], [row[3] for row in rows])
        self.state.pushed.insert(d.loc for d in batch)  # in the same commit: never neither
        self.runs.commit()
        queued = self._queued  # the key gate counts new copies only (not one Redis kept: a running job's)
        self.sent([d for d in batch if queued is None or d.envelope.id in queued])
        self.windows.of(queue).pushed(len(batch))
        self.gate.pushed(len(batch))
        self.refilled += len(batch)
        return len(batch)

    def _try_push(self, batch: list[Delivery]) -> bool:
        """Push once; ``False`` (logged once per outage or pause) if the transport refused.

        The ids of the jobs queued are left in :attr:`_queued` (``None``: not known).
        """
        self._queued = frozenset()
        try:
            result = self.transport.push(batch)
        except UnencodableJobs as exc:
            for delivery, reason in exc.rejected:
                self.state.record_invalid(delivery.loc, delivery.envelope.id)
                log.error("skipping job %s: the transport cannot encode it: %s", delivery.envelope.id, reason)
            refused = {id(d) for d, _ in exc.rejected}
            rest = [d for d in batch if id(d) not in refused]
            return not rest or self._try_push(rest)  # (sets _queued)
        except RedisFull as exc:
            self.paused(exc)
            return False
        except RedisRefused:
            raise
        except TransportError as exc:
            log.debug("refill not pushed (Redis unavailable): %s", exc)
            return False
        self.state.count_duplicates(result.already_present)
        self.gate.sent(len(batch), result.sent_bytes)
        self._queued = result.queued
        return True

    def figures(self) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
        """Per queue: backlog (and per priority), window, target, oldest waiting; Redis's memory."""
        # Copies first (one C-level step each): metrics call this from their own thread.
        counts, windows, oldest = dict(self.runs.counts), dict(self.windows.queues), dict(self.oldest)
        prios = {q: dict(by) for q, by in list(self.runs.prios.items())}
        detail: dict[str, dict[str, Any]] = {}
        for q in sorted({*counts, *windows}):
            w = windows.get(q)
            detail[q] = {
                "backlog": counts.get(q, 0),
                "window": w.length if w is not None else None,
                "window_target": w.target if w is not None else None,
                "oldest_waiting": oldest.get(q) if counts.get(q) else None,
                # Keys as text: the snapshot is JSON (a dozen numbers at most per queue).
                "by_priority": {str(p): n for p, n in sorted(prios.get(q, {}).items(), reverse=True) if n},
            }
        gate, info = self.gate, self.gate.info
        memory = None
        if info is not None:
            memory = {
                "used": info.used,
                "maxmemory": info.maxmemory,
                "policy": info.policy,
                "high_water": gate.high_water,
                "paused": gate.paused,
                "last_oom": gate.last_oom,
            }
        return detail, memory
