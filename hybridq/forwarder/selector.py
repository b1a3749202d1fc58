"""Which waiting jobs the refill pushes next: priorities, aging, fair keys, and the limits' gate.

The run table (:mod:`hybridq.forwarder.runs`) holds each waiting job's priority, limit key and
lane. :meth:`Selector.pick` chooses up to ``n`` rows of one queue (docs/forwarder.md, "Priorities
and fairness"):

* **Priority, then age.** Higher priority first; within one priority, the order the jobs became
  eligible.
* **Aging.** One in :data:`AGE_EVERY` jobs the refill takes from a queue is its oldest waiting
  job, whatever its priority (counted per queue across refills, so it holds for a refill of one
  job too): a job waits behind at most ``AGE_EVERY - 1`` younger jobs per older one, never
  forever behind a stream of higher priorities.
* **Fair keys.** With ``--fair-key PATTERN`` (a glob on the limit key, ``=W`` a weight), every
  key matching a pattern is a lane of its own, and the rest of the queue one more lane: the
  lanes are taken round robin, W jobs per visit (1 by default; a key matching several patterns
  has the weight of the last one given), from where the last refill
  stopped; priority then age order holds within a lane. A visit costs one or two index probes,
  so a refill costs O(jobs it takes), not O(keys).
* **The gate** (:class:`KeyGate`, the limits of ``hybridq.forwarder.keylimits``): a job with a
  limit key is taken only while the gate has room for its key; a key without room is skipped
  inside the index (its rows wait on disk) and never holds back the keys behind it.

This module must not import redis or rq.
"""

from __future__ import annotations

import fnmatch
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from hybridq.errors import ConfigError
from hybridq.forwarder.runs import RunTable
from hybridq.transport.base import Loc

__all__ = ["AGE_EVERY", "FairKey", "KeyGate", "Lanes", "Selector", "Unlimited", "parse_fair_keys"]

#: One in this many jobs a refill takes from a queue is its oldest waiting (the aging rule).
AGE_EVERY = 10
#: The largest weight a fair key may have.
MAX_WEIGHT = 1000


class KeyGate(Protocol):
    """What the limits allow now (``hybridq.forwarder.keylimits`` implements it)."""

    def room(self, key: str) -> int:
        """Jobs of limit key ``key`` that may be pushed now (``sys.maxsize``: not limited)."""
        ...

    def pushed(self, key: str, n: int) -> None:
        """``n`` jobs of ``key`` were just pushed (after the transport accepted them)."""
        ...


class Unlimited:
    """The default gate: every key has room."""

    def room(self, key: str) -> int:  # noqa: ARG002 - the protocol's signature
        """No limit."""
        return sys.maxsize

    def pushed(self, key: str, n: int) -> None:
        """Nothing to count."""


@dataclass(frozen=True, slots=True)
class FairKey:
    """A glob on the limit key whose matching keys are taken round robin, ``weight`` per visit."""

    pattern: str
    weight: int = 1


def parse_fair_keys(specs: Iterable[str]) -> tuple[FairKey, ...]:
    """``'tenant:*'`` or ``'tenant:big=3'`` each; ConfigError (one line) for a bad one."""
    out: list[FairKey] = []
    for spec in specs:
        pattern, sep, weight = spec.rpartition("=") if "=" in spec else (spec, "", "")
        if not pattern or any(ch.isspace() for ch in pattern) or not pattern.isprintable():
            raise ConfigError(
                f"fair key {spec!r}: give a glob on the limit key, e.g. 'tenant:*' or 'tenant:big=3'"
            )
        if sep and not (weight.isdigit() and 1 <= int(weight) <= MAX_WEIGHT):
            raise ConfigError(
                f"fair key {spec!r}: the weight after '=' must be an integer from 1 to {MAX_WEIGHT}"
            )
        out.append(FairKey(pattern, int(weight) if sep else 1))
    return tuple(out)


class Lanes:
    """The lane of each limit key: itself when it matches a fair key, else '' (the rest)."""

    def __init__(self, fair: Sequence[FairKey] = ()) -> None:
        self.fair = tuple(fair)
        self._cache: dict[str, tuple[str, int]] = {}

    @property
    def signature(self) -> str:
        """What the run table's lanes were computed under (they are recomputed when it changes)."""
        return json.dumps([k.pattern for k in self.fair]) if self.fair else ""

    def _match(self, key: str) -> tuple[str, int]:
        found = self._cache.get(key)
        if found is None:
            found = ("", 1)
            for fk in reversed(self.fair):  # the last that matches: 'tenant:*', then 'tenant:big=3'
                if fnmatch.fnmatchcase(key, fk.pattern):
                    found = (key, fk.weight)
                    break
            if len(self._cache) < 65536:
                self._cache[key] = found
        return found

    def lane(self, key: str) -> str:
        """The lane of ``key``."""
        return self._match(key)[0] if self.fair and key else ""

    def weight(self, lane: str) -> int:
        """Jobs a visit of ``lane`` takes."""
        return self._match(lane)[1] if lane else 1


#: Picked rows: location, order, limit key ('' for none).
Picked = list[tuple[Loc, float, str]]

_COLS = "SELECT chain, seg, off, ord, lkey FROM runs"
_NOT_BLOCKED = " AND lkey NOT IN (SELECT value FROM json_each(?))"


class Selector:
    """Picks the rows a refill pushes (see the module docstring)."""

    def __init__(self, runs: RunTable, gate: KeyGate, lanes: Lanes | None = None) -> None:
        self.runs = runs
        self.gate = gate
        self.lanes = lanes or Lanes()
        #: Jobs taken per queue since start (the aging rule counts them).
        self.taken: dict[str, int] = {}
        #: Per queue, the lane the last visit took from (the round robin goes on after it).
        self.cursor: dict[str, str] = {}
        self._rooms: dict[str, int] = {}
        self._blocked: set[str] = set()

    def open(self) -> None:
        """Lane the run table's rows under this selector's fair keys (once, at start)."""
        self.runs.lanes(self.lanes.lane, self.lanes.signature)

    def fits(self, key: str | None) -> bool:
        """Whether a job of ``key`` may go now (counted against the key's room for this pick)."""
        if not key:
            return True
        room = self._rooms.get(key)
        if room is None:
            room = self.gate.room(key)
        if room <= 0:
            self._blocked.add(key)
            self._rooms[key] = 0
            return False
        self._rooms[key] = room - 1
        return True

    def begin(self) -> None:
        """Forget the rooms asked of the gate (each refill or batch of reads asks again)."""
        self._rooms.clear()
        self._blocked.clear()

    def pick(self, queue: str, n: int) -> Picked:
        """Up to ``n`` rows of ``queue`` to push now, in push order."""
        self.begin()
        before = self.taken.get(queue, 0)
        aged = (before + n) // AGE_EVERY - before // AGE_EVERY
        seen: set[Loc] = set()
        out: Picked = []
        if aged:
            out += self._scan(queue, None, aged, seen)
        # The aged rows go first: the oldest, and so among one priority the order is kept.
        if self.lanes.fair:
            out += self._round_robin(queue, n - len(out), seen)
        else:
            out += self._scan(queue, "", n - len(out), seen)
        self.taken[queue] = before + len(out)
        return out

    def _scan(self, queue: str, lane: str | None, n: int, seen: set[Loc]) -> Picked:
        """Up to ``n`` rows of ``lane`` (``None``: the whole queue, oldest first) the gate lets go."""
        out: Picked = []
        while n > len(out):
            blocked = len(self._blocked)
            sql, params = self._query(queue, lane, n - len(out) + len(seen))
            rows = self.runs.select(sql, params)
            for row in rows:
                if row[0] in seen or not self.fits(row[2]):
                    continue
                seen.add(row[0])
                out.append(row)
                if len(out) >= n:
                    break
            if len(rows) < n - len(out) + len(seen) or len(self._blocked) == blocked:
                break  # the lane is exhausted, or nothing new was refused: what is left is seen
        return out

    def _query(self, queue: str, lane: str | None, limit: int) -> tuple[str, list[object]]:
        params: list[object] = [queue]
        sql = _COLS + " WHERE queue = ?"
        if lane is not None:
            sql += " AND lane = ?"
            params.append(lane)
        if self._blocked:
            sql += _NOT_BLOCKED
            params.append(json.dumps(sorted(self._blocked)))
        sql += " ORDER BY ord" if lane is None else " ORDER BY prio DESC, ord"
        return sql + " LIMIT ?", [*params, limit]

    def _round_robin(self, queue: str, n: int, seen: set[Loc]) -> Picked:
        """Up to ``n`` rows, the lanes visited in turn from the cursor, ``weight`` rows each."""
        out: Picked = []
        lane = self.cursor.get(queue)
        first: str | None = None
        empty_round = True
        while len(out) < n:
            after, lane = lane, self.runs.next_lane(queue, lane)
            if lane is None:
                if after is None:
                    break  # no rows at all
                continue  # past the last lane: the next probe starts at the first
            if lane == first:
                if empty_round:
                    break  # a whole round found nothing the gate lets go
                empty_round = True
            if first is None:
                first = lane
            if lane and lane in self._blocked:
                continue
            got = self._scan(queue, lane, min(self.lanes.weight(lane), n - len(out)), seen)
            if got:
                empty_round = False
                out += got
                self.cursor[queue] = lane
        return out
