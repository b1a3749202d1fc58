"""The forwarder's gate for per-key limits: how many jobs of a limit key may be pushed now.

The limits are enforced by the workers' claims, in Redis (``hybridq.worker.limit_scripts``):
a run over its key's limit does not start, and the job comes back to be delivered again. This
gate keeps that rare. Jobs of a key with no room stay in the run table, on disk, and never
block other keys' jobs (the selector skips the key). Once per step, :meth:`KeyLimits.look` asks
Redis, in one call, how the keys asked about since the last look stand (runs holding a slot,
jobs pushed and not yet claimed by any forwarder, starts in the rate's period, a quarantine
after Redis lost its state); between looks the room is counted down locally as jobs are pushed
(docs/forwarder.md, "Limits per key"): a key with room is read again only once its room was
read more than FRESH_S ago and less than half of it is left, or more than TRUST_S ago. The push
adds its copies to their keys' queued counts itself (RQ's); a call adds those of the refill.

A key never read is read with the chunk of jobs it comes in (:meth:`KeyLimits.prefetch`, one
call for the chunk), before the chunk is decided; one the gate could not read has no room until
the next look (a step away): the gate errs on the side of waiting. Without a Redis that can say
(the memory transport, sharded queues), every key is open and the claims alone enforce the
limits.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import math
import sys
import time
from collections.abc import Iterable, Mapping
from operator import attrgetter
from typing import Any, NamedTuple

from hybridq.errors import TransportError
from hybridq.protocol.keylimits import Limit, Limits
from hybridq.transport.base import Transport

__all__ = ["LOOK_MAX", "KeyLimits", "KeyState"]

log = logging.getLogger("hybridq.forwarder")

#: The most keys one look reads (the others wait for the next step's): about 3 Redis commands
#: each, inside one script.
LOOK_MAX = 10_000
#: A key's room read this recently is trusted (counted down by this forwarder's pushes) without
#: another look while it is above 0: a key with room costs one look a second, not one a step.
FRESH_S = 1.0
#: Past FRESH_S, a key's room is still trusted while at least half of what its read gave is left,
#: up to this long: counted down by this forwarder's pushes it never grows without a read, and a
#: key seen once or twice (a key per tenant, a job or two each) is then read once, not once per
#: job (docs/forwarder.md, "Limits per key"; docs/benchmarks.md, "The add in the push").
TRUST_S = 10.0
#: A key not looked at for this long (no job of it waits) leaves the figures.
SEEN_S = 30.0
#: The most keys the figures (``status``, metrics, the dashboard) show: held ones first.
FIGURES_MAX = 500


class KeyState(NamedTuple):
    """A limit key as the last look saw it (for ``status``, metrics and ``doctor``).

    A named tuple, not a frozen dataclass: one is made per key read (each key once with a key
    per tenant), and a frozen dataclass's ``__init__`` (a ``object.__setattr__`` per field) was
    a third of the gate's Python (docs/benchmarks.md, "One call fewer per claim"). Read its
    fields by name, as before: that it also unpacks and equals a plain tuple is not promised.
    """

    key: str
    policy: str
    running: int
    queued: int
    started: int
    quarantine_s: float
    room: int
    #: Since when (wall clock) the key has had no room while asked about; ``None``: it has room.
    blocked_since: float | None
    #: When it was looked at (wall clock).
    at: float


class KeyLimits:
    """The :class:`~hybridq.forwarder.selector.KeyGate` of the per-key limits.

    Args:
        limits: the policies (``--limit``).
        transport: where the state is read (:meth:`Transport.key_use`).
        lease_s: the forwarder's lease (a key's quarantine lasts at least one).
    """

    def __init__(self, limits: Limits, transport: Transport, lease_s: float) -> None:
        self.limits = limits
        self.transport = transport
        self.lease_s = lease_s
        #: Per key: its room (counted down by pushes since), when it was read (monotonic) and
        #: the room that read gave.
        self._room: dict[str, tuple[int, float, int]] = {}
        #: A key's policy: the globs matched once per key, in the policies' own memo (one memo of
        #: each key for the gate and the deliveries; docs/benchmarks.md, "One call fewer per claim").
        self._policy = limits.of
        self._asked: dict[str, None] = {}
        self._added: collections.Counter[str] = collections.Counter()
        self._seen: dict[str, KeyState] = {}
        self._open = False  # the transport cannot say: every key open
        #: The push adds its copies to the keys' queued counts (no add at the next look).
        self._push_counts = transport.counts_limited_pushes
        self._looked = False
        self._changed = False  # a prefetch held or freed a key since the last look
        #: Keys seen for the first time (with room) since the figures were made: news within
        #: FRESH_S, not at once (with thousands of keys, a new one at nearly every step).
        self._new = False
        #: The last figures made and when (monotonic): kept while no key was held or freed.
        self._figures: tuple[dict[str, dict[str, Any]], float] | None = None

    @property
    def reads(self) -> bool:
        """Whether the gate reads the keys' use (``False``: every key open, the claims alone enforce)."""
        return not self._open

    def room(self, key: str) -> int:
        """Jobs of ``key`` that may be pushed now (``sys.maxsize``: not limited)."""
        if self._open:
            return sys.maxsize
        # Only limited keys are read: a key with a room is limited (no policy looked up).
        entry = self._room.get(key)
        if entry is None:
            if self._policy(key) is None:
                return sys.maxsize
            self._asked[key] = None  # read at the next look
            return 0
        room, at, read = entry
        if room <= 0:
            self._asked[key] = None  # read at the next look
            return 0
        if (age := time.monotonic() - at) > FRESH_S and (2 * room < read or age > TRUST_S):
            self._asked[key] = None
        return room

    def pushed(self, key: str, n: int, *, by_push: bool = True) -> None:
        """``n`` jobs of ``key`` were queued: less room until the next look says otherwise.

        Added to the key's queued count at the next look, unless the transport's push counted
        them already (``by_push`` and :attr:`Transport.counts_limited_pushes`); the reconcile
        pass's copies (``by_push=False``) always are.
        """
        self.pushed_keys({key: n}, by_push=by_push)

    def pushed_keys(self, counts: Mapping[str, int], *, by_push: bool = True) -> None:
        """:meth:`pushed` of each key of ``counts``, in one call.

        A push's chunk tells its keys at once: with a key per tenant nearly every job has a key
        of its own, and a call per key was a Python call per job (docs/benchmarks.md, "The
        forwarder's next cuts per job").
        """
        if self._open:
            return
        rooms, policy, added = self._room, self._policy, self._added
        add = not (by_push and self._push_counts)
        for key, n in counts.items():
            entry = rooms.get(key)
            if entry is None:
                if policy(key) is None:
                    continue
                entry = (0, -math.inf, 0)
            rooms[key] = (entry[0] - n, entry[1], entry[2])
            if add:
                added[key] += n

    def prefetch(self, keys: Iterable[str]) -> None:
        """Read now, in one call, those of ``keys`` never read: their jobs go with this batch.

        Without it a key's first sight would send its jobs through the run table (a row
        written, fsync'd, picked and read back a step later). Keys read before are left to
        :meth:`look` (their room is counted down locally between looks). Redis down: nothing
        is read, the keys wait for the next look as before (the push fails the same way).
        """
        if not self.limits or self._open:
            return
        room, policy = self._room, self._policy
        policies: dict[str, Limit | None] = {}
        for k in keys:
            if k not in room and k not in policies and (limit := policy(k)) is not None:
                policies[k] = limit
        if not policies:
            return
        if len(policies) > LOOK_MAX:  # (the rest wait for the next look)
            policies = dict(itertools.islice(policies.items(), LOOK_MAX))
        try:
            self._changed |= self._read(policies)
        except TransportError as exc:
            log.debug("cannot read the limits' use: %s", exc)

    def forget(self) -> None:
        """Redis lost its state: no room is trusted; each key is read again (its quarantine) first.

        A key with room is otherwise read again a second later at the soonest (:data:`FRESH_S`), and its
        jobs pushed meanwhile would meet the claims' refusal, coming back two leases later.
        """
        self._room.clear()

    def look(self) -> bool:
        """Read the keys asked about (and add what was pushed) in one call; once per step.

        Returns whether a key's figures changed since the last look (the stats snapshot is
        written again).

        Raises:
            TransportError: Redis is down (the room stays as it was: nothing more is pushed).
        """
        if not self.limits or self._open or (self._looked and not (self._asked or self._added)):
            changed = self._changed
        else:
            policy = self._policy
            names = list(self._asked)[:LOOK_MAX]
            changed = self._read({key: policy(key) for key in names}) or self._changed
        self._changed = False
        if not changed and self._new:  # new keys: shown a second late at most
            changed = self._figures is None or time.monotonic() - self._figures[1] > FRESH_S
        return changed

    def _read(self, policies: dict[str, Limit | None]) -> bool:
        """Read ``policies``' keys, add what was pushed to every key, in one call; whether figures changed.

        Each key's policy is looked up once, by the caller; one pass per key read, no call per
        key: with a key per tenant each key is read once or twice, and the policy's second
        lookup, a ``_free`` and a ``_note`` call and a frozen-policy hash per key were most of
        the gate's Python (docs/benchmarks.md, "The limits' Python per job").
        """
        self._looked = True  # the first read starts the limits' epoch on a new Redis at once
        # The keys pushed to are only added to: their room is counted down here until asked again.
        periods = {key: limit.period_ms if limit is not None else 0 for key, limit in policies.items()}
        uses = self.transport.key_use(periods, dict(self._added), lease_s=self.lease_s)
        self._added.clear()
        if uses is None:
            self._open = True
            log.info("the transport cannot report the limits' use: the workers' claims alone enforce them")
            return False
        asked = self._asked
        if asked:  # (a prefetch's keys were never asked: nothing to drop, most reads)
            for key in policies:
                asked.pop(key, None)
        now, mono = time.time(), time.monotonic()
        if len(self._room) > 4 * LOOK_MAX:  # keys not read for a while go (asked again, they are read)
            self._room = {k: v for k, v in self._room.items() if mono - v[1] <= 2 * TRUST_S}
        changed = new = False
        rooms, seen = self._room, self._seen
        for key, use in uses.items():
            limit = policies.get(key) or self._policy(key)  # (a transport's extra key: its own)
            # The room the read gives (what ``_free`` was): 0 in a quarantine.
            if limit is None:
                free = sys.maxsize
            elif use.quarantine_s > 0:
                free = 0
            else:
                free = sys.maxsize
                if limit.concurrency:
                    free = limit.concurrency - use.running - use.queued
                if limit.rate:
                    free = min(free, limit.rate - use.started - use.queued)
                if free < 0:  # noqa: PLR1730 (not max(): a call per key)
                    free = 0
            rooms[key] = (free, mono, free)
            # What the look saw of the key (what ``_note`` was): re-inserted last, so the dict
            # stays in look order.
            before = seen.pop(key, None)
            if before is None:
                blocked = None if free > 0 else now
                policy = "" if limit is None else limit.text()
            else:
                blocked = None if free > 0 else (before.blocked_since or now)
                policy = before.policy
            # (tuple.__new__: the named tuple's own __new__ is a Python frame, one per key read)
            seen[key] = _state(
                KeyState,
                (key, policy, use.running, use.queued, use.started, use.quarantine_s, free, blocked, now),
            )
            # Only a key held or freed (or new and held) is news for the snapshot: counts move
            # at every step; a new key with room is shown within FRESH_S (:meth:`look`).
            if before is None:
                if blocked is None:
                    new = True
                else:
                    changed = True
            elif (before.blocked_since is None) != (blocked is None):
                changed = True
        while len(seen) > 4 * LOOK_MAX:  # keys no longer asked about go, oldest look first
            del seen[next(iter(seen))]
        if new:
            self._new = True
        if changed:
            self._figures = None
        return changed

    def figures(self) -> dict[str, dict[str, Any]]:
        """Up to :data:`FIGURES_MAX` keys read within :data:`SEEN_S`, held longest first (any thread).

        For the stats snapshot, which is written at steps: thousands of keys would make it large.
        The same figures (the same object) are given again for up to :data:`FRESH_S` while no
        key was held or freed: made again at each of a burn's saves, 500 keys' figures and their
        JSON were a tenth of the forwarder's time.
        """
        cached, mono = self._figures, time.monotonic()
        if cached is not None and mono - cached[1] <= FRESH_S:
            return cached[0]
        figures = self._make_figures()
        self._figures, self._new = (figures, mono), False
        return figures

    def _make_figures(self) -> dict[str, dict[str, Any]]:
        cutoff = time.time() - SEEN_S
        seen = list(self._seen.values())
        # Not one sort of every key: thousands of keys cost 12 ms a snapshot, written at each step.
        shown = sorted((s for s in seen if s.blocked_since is not None and s.at >= cutoff), key=_held_order)
        if len(shown) < FIGURES_MAX:
            free = [s for s in seen if s.blocked_since is None and s.at >= cutoff]
            shown += heapq.nlargest(FIGURES_MAX - len(shown), free, key=_running)  # ties: look order
        return {
            s.key: {
                "policy": s.policy,
                "running": s.running,
                "queued": s.queued,
                "started": s.started,
                "quarantine_s": s.quarantine_s,
                "room": min(s.room, 2**31),
                "blocked_since": s.blocked_since,
            }
            for s in shown[:FIGURES_MAX]
        }

    def states(self) -> list[KeyState]:
        """The limit keys as the last looks saw them (at most a few thousand)."""
        return list(self._seen.values())

    def safe_look(self) -> None:
        """:meth:`look`, a Redis outage logged at debug level (the push fails the same way)."""
        try:
            self.look()
        except TransportError as exc:
            log.debug("cannot read the limits' use: %s", exc)


_running = attrgetter("running")
_state = tuple.__new__


def _held_order(state: KeyState) -> tuple[float, int]:
    """Held longest first, then most running."""
    return (state.blocked_since or 0.0, -state.running)
