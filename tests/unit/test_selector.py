"""The run table's new columns and the selector over them (issue 30): a migrated file, priority
then age, the aging rule, the key gate, fair keys. The run table alone, no forwarder (~1 s)."""

from __future__ import annotations

import random
import sqlite3
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest
from hybridq import Queue, stats
from hybridq.errors import ConfigError
from hybridq.forwarder import Forwarder
from hybridq.forwarder.runs import RunTable
from hybridq.forwarder.selector import AGE_EVERY, Lanes, Selector, Unlimited, parse_fair_keys
from hybridq.ops.metrics import window_metrics

from tests import tasks
from tests.unit.test_window import WindowedTransport, forwarder


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
        self.prefetched: list[set[str]] = []

    def room(self, key: str) -> int:
        self.asked[key] += 1
        return self.rooms.get(key, sys.maxsize)

    def pushed(self, key: str, n: int, *, by_push: bool = True) -> None:
        self.rooms[key] = self.rooms.get(key, sys.maxsize) - n

    def pushed_keys(self, counts: Mapping[str, int], *, by_push: bool = True) -> None:
        for key, n in counts.items():
            self.pushed(key, n, by_push=by_push)

    def prefetch(self, keys: Iterable[str]) -> None:
        """Nothing to read (the rooms are fixed): only noted."""
        self.prefetched.append(set(keys))


def offsets(rows: list[tuple[tuple[str, int, int], float, str, int]]) -> list[int]:
    return [row[0][2] for row in rows]


def write_before_priorities(path: Path) -> None:
    """A run table as a release before priorities wrote it: 5 jobs of queue 'q', no prio column."""
    (path / "runs").mkdir()
    old = sqlite3.connect(path / "runs" / "runs.sqlite")
    old.executescript(
        """CREATE TABLE runs (chain TEXT NOT NULL, seg INTEGER NOT NULL, off INTEGER NOT NULL,
        queue TEXT NOT NULL, ord REAL NOT NULL, PRIMARY KEY (chain, seg, off)) WITHOUT ROWID;
        CREATE INDEX ready ON runs(queue, ord);"""
    )
    old.executemany("INSERT INTO runs VALUES ('w', 1, ?, 'q', ?)", [(i, float(i)) for i in range(5)])
    old.commit()
    old.close()


def test_a_file_written_before_priorities_gets_the_columns_and_keeps_its_rows(tmp_path: Path) -> None:
    write_before_priorities(tmp_path)
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


def test_stats_read_a_file_written_before_priorities_as_priority_0(tmp_path: Path) -> None:
    write_before_priorities(tmp_path)  # no forwarder has opened (migrated) it yet
    detail = stats(tmp_path, redis_url=None, outbox=None, exact=True)["queue_detail"]["q"]
    assert detail["backlog"] == 5
    assert detail["waiting_by_priority"] == {"0": 5}
    assert detail["top_priority"] == 0


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
        runs.remove("q", [row[0] for row in got])
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
    lanes = Counter(row[2] for row in got)
    # Lanes in order ('', big, huge, small), a visit takes the lane's weight: 1 + 3 + 1 + 1, then
    # the next round starts: '' and big (the pick's last).
    assert lanes == {"": 2, "tenant:big": 4, "tenant:huge": 1, "tenant:small": 1}
    # Over a longer run the small tenant is done long before the huge one's backlog.
    taken: list[str] = [row[2] for row in got]
    runs.remove("q", [row[0] for row in got])
    while runs.waiting("q") > 900:
        more = sel.pick("q", 10)
        runs.remove("q", [row[0] for row in more])
        taken += [row[2] for row in more]
    assert taken.count("tenant:small") == 3
    assert taken.count("") == 2
    runs.close()


def test_with_fair_keys_a_pick_is_pushed_in_the_order_its_lanes_were_visited(tmp_path: Path) -> None:
    # A refill's batch goes to Redis in the order of its rows: sorted by age, every job a big
    # tenant (older) had in the batch went ahead of a small one's, up to a batch (500) of them
    # (test_priorities' fair-key scene: the small tenant's 10 jobs at the tail of a 100-job refill).
    runs = table(tmp_path)
    sel = Selector(runs, Unlimited(), Lanes(parse_fair_keys(["tenant:*"])))
    sel.open()
    add(runs, 100, key="tenant:big")
    add(runs, 10, start=1000, key="tenant:small")
    got = sel.pick("q", 20)  # the aging rule's share: 2 (the oldest two not taken), behind the lanes'
    assert offsets(got) == [*(o for i in range(9) for o in (i, 1000 + i)), 9, 10]
    runs.remove("q", [row[0] for row in got])
    sel.taken["q"] = 1  # no aged job in this one: the lanes alone, from where the last pick stopped
    assert offsets(sel.pick("q", 4)) == [11, 1009, 12, 13]
    runs.close()


def test_with_fair_keys_a_priority_9_job_still_goes_first_in_its_batch(tmp_path: Path) -> None:
    # Priority first, the lanes' visit order within a priority: kept in visit order alone, the
    # priority-9 job of the last lane entered Redis behind one job of each of the 19 lanes before.
    runs = table(tmp_path)
    sel = Selector(runs, Unlimited(), Lanes(parse_fair_keys(["tenant:*"])))
    sel.open()
    for t in range(20):
        add(runs, 50, start=t * 50, key=f"tenant:{t:02d}")
    add(runs, 1, start=99999, prio=9, key="tenant:19")
    sel.taken["q"] = 1  # no aged job in this pick
    got = sel.pick("q", 100)
    assert [row[3] for row in got].index(9) == 0
    assert [row[2] for row in got[1:20]] == [f"tenant:{t:02d}" for t in range(19)]  # then visit order
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
def test_bad_fair_keys_are_one_line_errors(spec: str, journal_dir: Path) -> None:
    with pytest.raises(ConfigError, match="fair key"):
        parse_fair_keys([spec])
    with pytest.raises(ConfigError, match="fair key"):  # before anything is created
        Forwarder(journal_dir, WindowedTransport(), fair_keys=(spec,))
    assert not journal_dir.exists()


def test_fair_keys_given_as_one_string_are_refused() -> None:
    with pytest.raises(ConfigError, match="a list of globs"):
        parse_fair_keys("tenant:*")


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


def test_a_pick_has_the_gate_read_a_chunks_keys_it_was_not_asked_about_in_one_call(tmp_path: Path) -> None:
    runs = table(tmp_path)
    for i in range(30):
        add(runs, 1, start=i, key=f"k:{i % 10}" if i % 3 else "")
    gate = Gate({"k:1": 0})
    sel = Selector(runs, gate)
    sel.begin()
    assert len(sel.pick("q", 30)) == 28  # k:1's 2 rows wait
    assert gate.prefetched == [{f"k:{i}" for i in range(10)}], "one call for the chunk, before any room"
    sel.pick("q", 30)
    assert gate.prefetched[1:] == [], "the keys asked since begin() are not read again"
    runs.close()


def reference_pick(
    rows: dict[int, tuple[int, float, str]], rooms: dict[str, int], n: int, aged: int
) -> list[int]:
    """The rule, spelled out over a list: priority then age under the gate's rooms, then the oldest."""
    left = dict(rooms)

    def fits(key: str) -> bool:
        if not key or left.get(key, sys.maxsize) > 0:
            if key:
                left[key] = left.get(key, sys.maxsize) - 1
            return True
        return False

    main = []
    for off in sorted(rows, key=lambda o: (-rows[o][0], rows[o][1], o)):
        if len(main) == n - aged:
            break
        if fits(rows[off][2]):
            main.append(off)
    for off in sorted(rows, key=lambda o: (rows[o][1], o)):
        if len(main) == n:
            break
        if off not in main and fits(rows[off][2]):
            main.append(off)
    return sorted(main, key=lambda o: (-rows[o][0], rows[o][1], o))


def test_the_selection_matches_the_rule_spelled_out(tmp_path: Path) -> None:

    rng = random.Random(30)
    runs = table(tmp_path)
    rows = {
        i: (
            rng.choice([0, 0, 0, 5, 9]),
            rng.random() * 1000,
            rng.choice(["", "", *(f"k{j}" for j in range(8))]),
        )
        for i in range(600)
    }
    runs.add((("w", 1, off), "q", order, prio, key) for off, (prio, order, key) in rows.items())
    runs.commit()
    sel = Selector(runs, Unlimited())
    for step in range(30):
        rooms = {f"k{j}": rng.randint(0, 4) for j in range(8)}
        sel.gate = Gate(dict(rooms))
        sel.begin()  # a refill: the gate is asked afresh
        n = rng.randint(1, 40)
        before = sel.taken.get("q", 0)
        aged = (before + n) // AGE_EVERY - before // AGE_EVERY
        got = offsets(sel.pick("q", n))
        assert got == reference_pick(rows, rooms, n, aged), step
        runs.remove("q", [("w", 1, o) for o in got])
        for o in got:
            del rows[o]
    runs.close()


def test_stats_and_metrics_show_the_backlog_per_priority(journal_dir: Path) -> None:

    q = Queue("default", journal=journal_dir)
    q.enqueue_many(q.prepare(tasks.add, [i, i]) for i in range(30))
    q.enqueue_many(q.prepare(tasks.add, [i, i], priority=7) for i in range(4))
    f = forwarder(journal_dir, WindowedTransport(), window_min=10, window_max=10)
    try:
        f.step()  # 10 pushed as read, 24 wait: 20 of priority 0, 4 of priority 7
        assert f.backlog.figures()[0]["default"]["by_priority"] == {"7": 4, "0": 20}
        families = {m.name: m for m in window_metrics(f.backlog)}
        samples = {
            s.labels["priority"]: s.value for s in families["hybridq_queue_backlog_priority_jobs"].samples
        }
        assert samples == {"7": 4.0, "0": 20.0}
    finally:
        f.close()
    for exact in (False, True):
        detail = stats(journal_dir, redis_url=None, outbox=None, exact=exact)["queue_detail"]["default"]
        assert detail["waiting_by_priority"] == {"7": 4, "0": 20}, exact
        assert detail["top_priority"] == 7


def test_removing_rows_keeps_the_counts_whether_or_not_they_were_there(tmp_path: Path) -> None:
    runs = table(tmp_path)
    add(runs, 5, prio=3)
    add(runs, 5, start=10, prio=0)
    runs.remove("q", [("w", 1, 0), ("w", 1, 1)], [3, 3])
    runs.remove("q", [("w", 1, 2), ("w", 1, 99)], [3, 0])  # one was never there
    runs.remove("q", [("w", 1, 10), ("w", 1, 98)])  # no priorities given: each delete says
    assert runs.counts == {"q": 6}
    assert runs.prios == {"q": {3: 2, 0: 4}}
    runs.rollback()
    assert runs.counts == {"q": 10}  # nothing committed: as it was
    runs.close()


def test_the_dashboard_shows_the_top_priority_waiting() -> None:
    from hybridq.http.dashboard.queues import queue_rows  # the page's rows, as the template gets them

    stats_ = {
        "queues": {"a": 5, "b": 1},
        "queue_detail": {"a": {"top_priority": 7}, "b": {"top_priority": None}},
    }
    rows = queue_rows(stats_, None, {}, None, 0.0)
    assert rows["a"]["top_priority"] == 7
    assert "top_priority" not in rows["b"]  # shown as "-"


@pytest.mark.timeout(10)
def test_a_first_lane_the_gate_refuses_does_not_stall_the_round_robin(tmp_path: Path) -> None:
    runs = table(tmp_path)
    add(runs, 5, key="tenant:a")  # the first lane: room for one
    add(runs, 2, start=10, key="tenant:b")
    sel = Selector(runs, Gate({"tenant:a": 1}), Lanes(parse_fair_keys(["tenant:*"])))
    sel.open()
    sel.taken["q"] = 1  # keep the aging rule's turn out of this pick
    assert offsets(sel.pick("q", 10)) == [0, 10, 11]  # all the gate lets go, then it stops
    runs.close()


@pytest.mark.timeout(30)
def test_fair_lanes_under_a_random_gate_take_all_it_lets_go_and_stop(tmp_path: Path) -> None:
    rng = random.Random(31)
    keys = ["", "tenant:a", "tenant:b", "tenant:c", "other:x"]
    for case in range(60):
        runs = table(tmp_path / str(case))
        rows = {
            i: (rng.randint(0, 3), float(rng.randint(0, 50)), rng.choice(keys))
            for i in range(rng.randint(1, 60))
        }
        runs.add((("w", 1, off), "q", order, prio, key) for off, (prio, order, key) in rows.items())
        runs.commit()
        fair = rng.choice([["tenant:*"], ["tenant:*", "tenant:b=3"], ["tenant:*", "other:*=2"]])
        sel = Selector(runs, Unlimited(), Lanes(parse_fair_keys(fair)))
        sel.open()
        for _ in range(10):
            rooms = {k: rng.randint(0, 3) for k in keys[1:] if rng.random() < 0.6}
            sel.gate = Gate(dict(rooms))
            sel.begin()
            n = rng.randint(1, 15)
            got = sel.pick("q", n)
            locs = [row[0] for row in got]
            assert len(set(locs)) == len(locs), case
            per_key = Counter(rows[o][2] for o in offsets(got))
            assert all(per_key[k] <= room for k, room in rooms.items()), case
            waiting = Counter(key for _, _, key in rows.values())
            lets_go = sum(min(c, rooms.get(k, c)) if k else c for k, c in waiting.items())
            assert len(got) == min(n, lets_go), case
            runs.remove("q", locs)
            for o in offsets(got):
                del rows[o]
        runs.close()


def test_a_full_disk_while_migrating_pauses_and_keeps_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from hybridq.errors import JournalIOError

    write_before_priorities(tmp_path)  # opening it builds the new indexes: new pages
    connect = sqlite3.connect

    def full_disk(*args: object, **kwargs: object) -> sqlite3.Connection:
        db = connect(*args, **kwargs)  # type: ignore[call-overload]
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        db.execute(f"PRAGMA max_page_count = {pages}")  # no page more: SQLITE_FULL (13)
        return db  # type: ignore[no-any-return]

    monkeypatch.setattr(sqlite3, "connect", full_disk)
    runs = RunTable(str(tmp_path))
    with pytest.raises(JournalIOError) as info:
        runs.open()
    assert info.value.errno == errno.ENOSPC  # the disk-full pause, as for the journal's writes
    assert "\n" not in str(info.value)
    assert not list((tmp_path / "runs").glob("*.damaged*"))  # a full disk is no damage
    monkeypatch.setattr(sqlite3, "connect", connect)  # room again
    runs = table(tmp_path)
    assert runs.waiting("q") == 5
    runs.close()


def test_a_second_damaged_file_does_not_overwrite_the_first(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "runs.sqlite"
    path.parent.mkdir()
    for n in range(2):
        path.write_bytes(b"not a database %d" % n * 100)
        table(tmp_path).close()  # moved aside, a new one made
    kept = sorted(p.read_bytes()[:16] for p in path.parent.glob("runs.sqlite.damaged*"))
    assert kept == [b"not a database 0", b"not a database 1"]


def test_the_key_gate_is_told_only_of_pushes_redis_accepted(journal_dir: Path) -> None:
    # A concurrency gate told of a push that never happened keeps its room taken for good.
    from hybridq import Retry

    q = Queue("default", journal=journal_dir)
    q.enqueue(tasks.add, 1, 2, limit_key="a", retry=Retry(max_attempts=2, backoff_s=0))
    transport = WindowedTransport()
    f = forwarder(journal_dir, transport, window_min=10, window_max=10)
    gate = Gate({"a": 10})
    f.backlog.keys = f.backlog.selector.gate = gate
    try:
        f.step()
        assert gate.rooms["a"] == 9  # the first attempt went

        def fail(env: object, attempt: int) -> None:
            raise RuntimeError("flaky")

        transport.work("default", fail, limit=1)
        transport.oom = True  # the retry's push meets OOM
        for _ in range(3):
            f.step()
        assert gate.rooms["a"] == 9, "told of a push Redis refused"
        transport.oom = False
        for _ in range(50):
            f.step()
            if len(transport.pushed_ids) == 2:
                break
        assert len(transport.pushed_ids) == 2  # the retry went, once
        assert gate.rooms["a"] == 8
    finally:
        f.close()
