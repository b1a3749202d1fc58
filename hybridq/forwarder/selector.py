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
  has the weight of the last one given), from where the last refill stopped; priority then age
  order holds within a lane, and a pick is pushed priority first, within one priority in the
  order its lanes were visited (the aging rule's share behind). A visit costs one or two index
  probes, so a refill costs O(jobs it takes), not O(keys).
* **The gate** (:class:`KeyGate`, the limits of ``hybridq.forwarder.keylimits``): a job with a
  limit key is taken only while the gate has room for its key; a key without room is skipped
  inside the index (its rows wait on disk) and never holds back the keys behind it. The keys
  of a chunk of rows the gate was not asked about are read in one call before the chunk is
  decided (:meth:`Selector.prefetch`); a fair lane's head, probed one row at a time, is not.

This module must not import redis or rq.
"""

from __future__ import annotations

import fnmatch
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
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

    def pushed(self, key: str, n: int, *, by_push: bool = True) -> None:
        """``n`` jobs of ``key`` were just queued (accepted by the transport; ``by_push``: its push)."""
        ...

    def pushed_keys(self, counts: Mapping[str, int], *, by_push: bool = True) -> None:
        """:meth:`pushed` of each key of ``counts`` (its jobs queued), in one call: a chunk's keys."""
        ...

    def prefetch(self, keys: Iterable[str]) -> None:
        """Read now, in one call, the room of those of ``keys`` never read (before deciding on them)."""
        ...


class Unlimited:
    """The default gate: every key has room."""

    def room(self, key: str) -> int:  # noqa: ARG002 - the protocol's signature
        """No limit."""
        return sys.maxsize

    def pushed(self, key: str, n: int, *, by_push: bool = True) -> None:
        """Nothing to count."""

    def pushed_keys(self, counts: Mapping[str, int], *, by_push: bool = True) -> None:
        """Nothing to count."""

    def prefetch(self, keys: Iterable[str]) -> None:
        """Nothing to read."""


@dataclass(frozen=True, slots=True)
class FairKey:
    """A glob on the limit key whose matching keys are taken round robin, ``weight`` per visit."""

    pattern: str
    weight: int = 1


def parse_fair_keys(specs: Iterable[str]) -> tuple[FairKey, ...]:
    """``'tenant:*'`` or ``'tenant:big=3'`` each; ConfigError (one line) for a bad one."""
    if isinstance(specs, str):  # each character would be a glob of its own
        raise ConfigError(f"fair keys must be a list of globs, not the string {specs!r}")
    out: list[FairKey] = []
    for spec in specs:
        pattern, sep, weight = spec.rpartition("=") if "=" in spec else (spec, "", "")
        if not pattern or any(ch.isspace() for ch in pattern) or not pattern.isprintable():
            raise ConfigError(
                f"fair key {spec!r}: give a glob on the limit key, e.g. 'tenant:*' or 'tenant:big=3'"
            )
        if sep and not (weight.isascii() and weight.isdigit() and 1 <= int(weight) <= MAX_WEIGHT):
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


#: A picked row: location, order, limit key ('' for none), priority.
Row = tuple[Loc, float, str, int]
Picked = list[Row]

_COLS = "SELECT chain, seg, off, ord, lkey, prio FROM runs"
_NOT_BLOCKED = " AND lkey NOT IN (SELECT value FROM json_each(?))"
#: The rest of a cursor's priority, after it, in a lane's order.
_SAME_PRIO = " AND prio = ? AND (ord, chain, seg, off) > (?, ?, ?, ?)"
_LANE_ORDER = " ORDER BY prio DESC, ord, chain, seg, off LIMIT ?"


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
        #: The refused keys as the JSON array the queries take, and the keys refused since.
        self._json = "[]"
        self._unjsoned: list[str] = []
        #: Within one pick, where each lane's scan stopped (its rows before are picked or refused).
        self._after: dict[str, Row] = {}

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
            if key not in self._blocked:
                self._blocked.add(key)
                self._unjsoned.append(key)
            self._rooms[key] = 0
            return False
        self._rooms[key] = room - 1
        return True

    def prefetch(self, keys: Iterable[str | None]) -> None:
        """Have the gate read, in one call, the keys of a chunk of jobs it was not asked about yet.

        Before the chunk is decided: a key's first sight then costs a share of one Redis call,
        not a step's wait in the run table.
        """
        rooms = self._rooms
        unasked = {key for key in keys if key and key not in rooms}
        if unasked:
            self.gate.prefetch(unasked)

    def _blocked_json(self) -> str:
        """The refused keys as the JSON array the queries take (the keys refused since appended).

        Not made again from the whole set each time it grew: with thousands of keys refused in
        one refill, that was a sort and a dump of all of them per chunk.
        """
        if self._unjsoned:
            more = json.dumps(self._unjsoned)
            self._json = more if self._json == "[]" else f"{self._json[:-1]},{more[1:]}"
            self._unjsoned.clear()
        return self._json

    def begin(self) -> None:
        """Forget the rooms asked of the gate (each refill or batch of reads asks again)."""
        self._rooms.clear()
        self._blocked.clear()
        self._json = "[]"
        self._unjsoned.clear()

    def pick(self, queue: str, n: int) -> Picked:
        """Up to ``n`` rows of ``queue`` to push now, in push order.

        Priority first; within one priority, age, or with fair keys the order the lanes were
        visited in, the aging rule's share behind.

        The gate's rooms are asked once per :meth:`begin` (a refill), so a refill's picks after
        the first skip the keys it refused without reading their rows again.
        """
        self._after.clear()
        before = self.taken.get(queue, 0)
        aged = (before + n) // AGE_EVERY - before // AGE_EVERY
        if not self.lanes.fair and len(self.runs.prios.get(queue, ())) <= 1:
            aged = 0  # one priority, one lane: the lane's order is the age order already
        out = self._round_robin(queue, n - aged) if self.lanes.fair else self._lane(queue, "", n - aged)
        rest: Picked = []
        if aged or len(out) < n - aged:  # the aging rule's share, and what the lanes left
            rest = self._oldest(queue, n - len(out), {row[0] for row in out})
        if self.lanes.fair:
            # Priority first; within one, the lanes' turns in the order they were taken, the rest
            # behind them (a stable sort on priority alone): sorted by age, a batch pushed every
            # job an older tenant had in it ahead of a younger one's.
            rest.sort(key=_push_order)
            out += rest
            out.sort(key=_priority)
        else:
            out += rest
            out.sort(key=_push_order)
        self.taken[queue] = before + len(out)
        return out

    def _lane(self, queue: str, lane: str, n: int) -> Picked:
        """Up to ``n`` rows of ``lane`` the gate lets go, after where this pick's last visit stopped."""
        out: Picked = []
        while len(out) < n:
            want = n - len(out)
            rows = self._lane_rows(queue, lane, want)
            self.prefetch(row[2] for row in rows)
            for row in rows:
                self._after[lane] = row
                if self.fits(row[2]):
                    out.append(row)
            if len(rows) < want:
                break  # the lane has no more rows the gate lets go
        return out

    def _lane_rows(self, queue: str, lane: str, limit: int) -> Picked:
        """The next ``limit`` rows of ``lane`` in its order: two index ranges after a cursor.

        The rest of the cursor's priority, then the lower ones: each an index range, so a lane
        visited again and again within one pick never scans the rows it passed.
        """
        base, params = _COLS + " WHERE queue = ? AND lane = ?", [queue, lane]
        if self._blocked:
            base += _NOT_BLOCKED
            params.append(self._blocked_json())
        after = self._after.get(lane)
        if after is None:
            return self.runs.select(base + _LANE_ORDER, [*params, limit])
        _, order, _, prio = after
        rows = self.runs.select(base + _SAME_PRIO + _LANE_ORDER, [*params, prio, order, *after[0], limit])
        if len(rows) < limit and prio > 0:
            rows += self.runs.select(base + " AND prio < ?" + _LANE_ORDER, [*params, prio, limit - len(rows)])
        return rows

    def _oldest(self, queue: str, n: int, taken: set[Loc]) -> Picked:
        """Up to ``n`` of the oldest rows of ``queue`` not in ``taken`` that the gate lets go.

        Read in pages from a cursor (an index range each): rows passed are never read again.
        """
        out: Picked = []
        after: Row | None = None
        page = n + len(taken)
        while len(out) < n:
            sql = _COLS + " WHERE queue = ?"
            params: list[object] = [queue]
            if after is not None:
                sql += " AND (ord, chain, seg, off) > (?, ?, ?, ?)"
                params += (after[1], *after[0])
            if self._blocked:
                sql += _NOT_BLOCKED
                params.append(self._blocked_json())
            rows = self.runs.select(sql + " ORDER BY ord, chain, seg, off LIMIT ?", [*params, page])
            self.prefetch(row[2] for row in rows)
            for row in rows:
                after = row
                if row[0] not in taken and self.fits(row[2]):
                    taken.add(row[0])
                    out.append(row)
                    if len(out) >= n:
                        break
            if len(rows) < page:
                break  # no more rows
            page = n
        return out

    def _round_robin(self, queue: str, n: int) -> Picked:
        """Up to ``n`` rows, the lanes visited in turn from the cursor, ``weight`` rows each.

        A lane's first visit in a pick is one index probe (the next lane's head, keys the gate
        refused skipped inside the index); a lane visited again goes on from where it stopped.
        It stops when a whole round (first lane to last) took nothing: a lane the gate refused
        leaves the probes, so no particular lane is sure to come round again.
        """
        out: Picked = []
        lane = self.cursor.get(queue)
        visited: set[str] = set()
        whole = lane is None  # whether this round started at the first lane
        took = False
        while len(out) < n:
            head = self._next_head(queue, lane)
            if head is None:
                if whole and not took:
                    break  # a whole round found nothing the gate lets go
                whole, took, lane = True, False, None  # the next probe starts at the first lane
                continue
            lane = self.lanes.lane(head[2])
            want = min(self.lanes.weight(lane), n - len(out))
            if lane in visited:
                got = self._lane(queue, lane, want)
            else:
                visited.add(lane)
                self._after[lane] = head
                got = [head] if self.fits(head[2]) else []
                if want > len(got):
                    got += self._lane(queue, lane, want - len(got))
            if got:
                took = True
                out += got
                self.cursor[queue] = lane
        return out

    def _next_head(self, queue: str, after: str | None) -> Row | None:
        """The first row the gate has not refused of the lane after ``after`` (``None``: the first)."""
        sql, params = _COLS + " WHERE queue = ?", [queue]
        if after is not None:
            sql += " AND lane > ?"
            params.append(after)
        if self._blocked:
            sql += _NOT_BLOCKED
            params.append(self._blocked_json())
        rows = self.runs.select(sql + " ORDER BY lane, prio DESC, ord, chain, seg, off LIMIT 1", params)
        return rows[0] if rows else None


def _push_order(row: Row) -> tuple[int, float, Loc]:
    return (-row[3], row[1], row[0])


def _priority(row: Row) -> int:
    return -row[3]
