"""The run table's new columns and the selector over them (issue 30): a migrated file, priority
then age, the aging rule, the key gate, fair keys. The run table alone, no forwarder (~1 s)."""

from __future__ import annotations

import sqlite3
import sys
from collections import Counter
from pathlib import Path

import pytest
from hybridq.errors import ConfigError
from hybridq.forwarder.runs import RunTable
from hybridq.forwarder.selector import Lanes, Selector, Unlimited, parse_fair_keys


def table(path: Path) -> RunTable:
    runs = RunTable(str(path))
    runs.open()
    return runs


def add(runs: RunTable, n: int, *, start: int = 0, prio: int = 0, key: str = "", queue: str = "q") -> None:
    runs.add((("w", 1, start + i), queue, float(start + i), prio, key) for i in range(n))
    runs.commit()


class Gate:
    """A key gate with a fixed room per key (what the limits would say)."""

    def __init__(self, rooms: dict[str, int]) -> None:
        self.rooms = rooms
        self.asked: Counter[str] = Counter()

    def room(self, key: str) -> int:
        self.asked[key] += 1
        return self.rooms.get(key, sys.maxsize)

    def pushed(self, key: str, n: int) -> None:
        self.rooms[key] = self.rooms.get(key, sys.maxsize) - n


def offsets(rows: list[tuple[tuple[str, int, int], float, str]]) -> list[int]:
    return [loc[2] for loc, _, _ in rows]


def test_a_file_written_before_priorities_gets_the_columns_and_keeps_its_rows(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    old = sqlite3.connect(tmp_path / "runs" / "runs.sqlite")
    old.executescript(
        """CREATE TABLE runs (chain TEXT NOT NULL, seg INTEGER NOT NULL, off INTEGER NOT NULL,
        queue TEXT NOT NULL, ord REAL NOT NULL, PRIMARY KEY (chain, seg, off)) WITHOUT ROWID;
        CREATE INDEX ready ON runs(queue, ord);"""
    )
    old.executemany("INSERT INTO runs VALUES ('w', 1, ?, 'q', ?)", [(i, float(i)) for i in range(5)])
    old.commit()
    old.close()
    runs = table(tmp_path)
    assert runs.waiting("q") == 5
    assert runs.prios == {"q": {0: 5}}
    add(runs, 2, start=10, prio=5)
    picked = Selector(runs, Unlimited()).pick("q", 7)
    assert offsets(picked) == [10, 11, 0, 1, 2, 3, 4]  # priority first, then age
    runs.close()
    again = table(tmp_path)  # opened twice: nothing to migrate, nothing lost
    assert again.waiting("q") == 7
    again.close()


def test_higher_priority_first_then_age_and_the_counts_per_priority(tmp_path: Path) -> None:
    runs = table(tmp_path)
    add(runs, 20, prio=0)
    add(runs, 5, start=100, prio=9)
    add(runs, 5, start=200, prio=4)
    assert runs.prios["q"] == {0: 20, 9: 5, 4: 5}
    sel = Selector(runs, Unlimited())
    sel.taken["q"] = 1  # the aging rule's next due turn is at 9 more jobs (checked below)
    got = offsets(sel.pick("q", 8))
    assert got == [100, 101, 102, 103, 104, 200, 201, 202]
    runs.remove("q", [("w", 1, o) for o in got])
    assert runs.prios["q"] == {0: 20, 4: 2}
    runs.close()


def test_aging_one_in_ten_is_the_oldest_whatever_keeps_coming(tmp_path: Path) -> None:
    # 50 old priority-0 jobs, and priority-9 jobs arriving faster than the refill takes them:
    # without aging the old ones would wait forever; with it, one in AGE_EVERY goes.
    runs = table(tmp_path)
    add(runs, 50, prio=0)
    sel = Selector(runs, Unlimited())
    old_taken = []
    for step in range(100):
        add(runs, 20, start=1000 + 20 * step, prio=9)
        got = sel.pick("q", 7)  # not a multiple of AGE_EVERY: the rule counts across refills
        runs.remove("q", [loc for loc, _, _ in got])
        old_taken += [o for o in offsets(got) if o < 50]
    assert old_taken == list(range(50))  # oldest first
    assert sel.taken["q"] == 700  # 70 turns of the rule: the 50 old ones all went
    runs.close()


def test_a_key_without_room_does_not_hold_back_the_keys_behind_it(tmp_path: Path) -> None:
    runs = table(tmp_path)
    add(runs, 1000, key="big")  # at the head, and the gate has no room for it
    add(runs, 3, start=5000, key="small")
    add(runs, 2, start=6000)  # no key
    gate = Gate({"big": 0, "small": 2})
    sel = Selector(runs, gate)
    got = sel.pick("q", 10)
    assert sorted(offsets(got)) == [5000, 5001, 6000, 6001]  # small's room is 2: its third waits
    assert gate.asked["big"] == 1  # asked once per pick, its rows skipped inside the index
    runs.close()


def test_fair_keys_take_the_lanes_round_robin_with_weights(tmp_path: Path) -> None:
    runs = table(tmp_path)
    sel = Selector(runs, Unlimited(), Lanes(parse_fair_keys(["tenant:*", "tenant:big=3"])))
    sel.open()
    sel.taken["q"] = 1  # keep the aging rule's turn out of these few picks
    add(runs, 1000, key="tenant:huge")
    add(runs, 100, start=2000, key="tenant:big")
    add(runs, 3, start=3000, key="tenant:small")
    add(runs, 2, start=4000)  # no key: the rest, one lane
    got = sel.pick("q", 8)
    lanes = Counter(key for _, _, key in got)
    # Lanes in order ('', big, huge, small), a visit takes the lane's weight: 1 + 3 + 1 + 1, then
    # the next round starts: '' and big (the pick's last).
    assert lanes == {"": 2, "tenant:big": 4, "tenant:huge": 1, "tenant:small": 1}
    # Over a longer run the small tenant is done long before the huge one's backlog.
    taken: list[str] = [key for _, _, key in got]
    runs.remove("q", [loc for loc, _, _ in got])
    while runs.waiting("q") > 900:
        more = sel.pick("q", 10)
        runs.remove("q", [loc for loc, _, _ in more])
        taken += [key for _, _, key in more]
    assert taken.count("tenant:small") == 3
    assert taken.count("") == 2
    runs.close()


def test_changing_the_fair_keys_relanes_the_rows_once(tmp_path: Path) -> None:
    runs = table(tmp_path)
    add(runs, 3, key="tenant:a")
    Selector(runs, Unlimited(), Lanes(parse_fair_keys(["tenant:*"]))).open()
    assert {r[0] for r in runs.db.execute("SELECT lane FROM runs")} == {"tenant:a"}
    Selector(runs, Unlimited()).open()  # fairness off: one lane again
    assert {r[0] for r in runs.db.execute("SELECT lane FROM runs")} == {""}
    runs.close()


@pytest.mark.parametrize("spec", ["", "a b", "tenant:*=0", "tenant:*=x", "=3"])
def test_bad_fair_keys_are_one_line_errors(spec: str) -> None:
    with pytest.raises(ConfigError, match="fair key"):
        parse_fair_keys([spec])


def test_every_push_path_asks_the_gate_and_tells_it_what_went(journal_dir: Path) -> None:
    from hybridq import Queue

    from tests import tasks
    from tests.unit.test_window import WindowedTransport, forwarder

    q = Queue("default", journal=journal_dir)
    a = [j.id for j in q.enqueue_many(q.prepare(tasks.add, [i, i], limit_key="a") for i in range(5))]
    free = [j.id for j in q.enqueue_many(q.prepare(tasks.add, [i, i]) for i in range(3))]
    transport = WindowedTransport()
    f = forwarder(journal_dir, transport, window_min=100, window_max=100)
    gate = Gate({"a": 2})
    f.backlog.keys = f.backlog.selector.gate = gate  # what Backlog(gate=...) wires
    try:
        f.step()  # the read-time path: 2 of a's, then its others and the rest wait on disk
        assert transport.pushed_ids[:2] == a[:2]
        assert gate.rooms["a"] == 0  # told: 2 pushed
        f.step()  # the refill: a's room is 0, the keyless jobs behind it go
        assert set(free) <= set(transport.pushed_ids)
        assert set(transport.pushed_ids) & set(a) == set(a[:2])
        gate.rooms["a"] = 2
        f.step()
        assert set(transport.pushed_ids) & set(a) == set(a[:4])
        assert f.state.runs.waiting("default") == 1
    finally:
        f.close()
