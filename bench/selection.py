"""The refill's selection cost per job: no keys, 10,000 distinct limit keys, fair keys on (issue 30).

Run it through ``scripts/bench-selection`` (see ``docs/benchmarks.md``). Each variant has its own
run table (``hybridq.forwarder.runs``) holding ``--rows`` waiting jobs of one queue, a tenth of
them priority 9:

* ``before``: the run table as it was before priorities (its old schema and queries, spelled out
  here): the baseline the others are compared with;
* ``no keys``: no job has a limit key;
* ``10k keys``: every job has one of 10,000 limit keys (``k:0`` ... ``k:9999``), fairness off;
* ``10k keys, fair``: the same, ``--fair-key 'k:*'``: the keys are taken round robin;
* ``10k keys, gate``: the same, fairness off, a key gate refusing every tenth key.

In rounds, interleaved (variants rotated each round): index ``--batch`` new jobs (``add`` and a
commit: the read path's cost) and pick and delete as many (the refill's table work: ``pick``,
``remove``, a commit; the push itself is not timed). Reported per variant: the median over
rounds of microseconds per job, each way, and its ratio to ``before``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Protocol

from hybridq.forwarder.runs import RunTable
from hybridq.forwarder.selector import Lanes, Selector, Unlimited, parse_fair_keys

KEYS = 10_000
REFILL_CHUNK = 500


class Variant(Protocol):
    name: str

    def add(self, start: int, n: int) -> None: ...
    def take(self, n: int) -> int: ...
    def close(self) -> None: ...


def key_of(i: int) -> str:
    return f"k:{(i * 7919) % KEYS}"  # keys spread over the rows, not in runs


class Old:
    """The run table before priorities: its schema, ``head`` and ``remove``, as they were."""

    name = "before"

    def __init__(self, path: str) -> None:
        os.makedirs(path)
        self.db = sqlite3.connect(os.path.join(path, "runs.sqlite"), isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA cache_size=-8000")
        self.db.executescript(
            """CREATE TABLE runs (chain TEXT NOT NULL, seg INTEGER NOT NULL, off INTEGER NOT NULL,
            queue TEXT NOT NULL, ord REAL NOT NULL, PRIMARY KEY (chain, seg, off)) WITHOUT ROWID;
            CREATE INDEX ready ON runs(queue, ord);"""
        )
        self.db.execute("BEGIN")

    def add(self, start: int, n: int) -> None:
        for i in range(start, start + n):
            self.db.execute("INSERT OR IGNORE INTO runs VALUES (?, ?, ?, ?, ?)", ("w", 1, i, "q", float(i)))
        self.db.execute("COMMIT")
        self.db.execute("BEGIN")

    def take(self, n: int) -> int:
        done = 0
        while done < n:
            rows = self.db.execute(
                "SELECT chain, seg, off, ord FROM runs WHERE queue = ? ORDER BY ord LIMIT ?",
                ("q", min(REFILL_CHUNK, n - done)),
            ).fetchall()
            for chain, seg, off, _ in rows:
                self.db.execute("DELETE FROM runs WHERE chain = ? AND seg = ? AND off = ?", (chain, seg, off))
            self.db.execute("COMMIT")
            self.db.execute("BEGIN")
            done += len(rows)
            if not rows:
                break
        return done

    def close(self) -> None:
        self.db.execute("COMMIT")
        self.db.close()


class GateEveryTenth(Unlimited):
    """A key gate refusing every tenth key (what binding limits look like to the selector)."""

    def room(self, key: str) -> int:
        return 0 if key.endswith("3") else sys.maxsize


class New:
    """The run table and selector as the refill uses them."""

    def __init__(self, name: str, path: str, *, keys: bool, fair: bool = False, gate: bool = False) -> None:
        self.name = name
        self.keys = keys
        os.makedirs(path)
        self.runs = RunTable(path)
        self.runs.open()
        lanes = Lanes(parse_fair_keys(["k:*"])) if fair else Lanes()
        self.selector = Selector(self.runs, GateEveryTenth() if gate else Unlimited(), lanes)
        self.selector.open()

    def add(self, start: int, n: int) -> None:
        keys = self.keys
        self.runs.add(
            (("w", 1, i), "q", float(i), 9 if i % 10 == 0 else 0, key_of(i) if keys else "")
            for i in range(start, start + n)
        )
        self.runs.commit()

    def take(self, n: int) -> int:
        done = 0
        self.selector.begin()  # one refill
        while done < n:
            rows = self.selector.pick("q", min(REFILL_CHUNK, n - done))
            self.runs.remove("q", [row[0] for row in rows], [row[3] for row in rows])
            self.runs.commit()
            done += len(rows)
            if not rows:
                break
        return done

    def close(self) -> None:
        self.runs.close()


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(prog="scripts/bench-selection", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=100_000, help="waiting jobs per table (default 100,000)")
    parser.add_argument("--batch", type=int, default=5_000, help="jobs added and taken per round (5,000)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (default 7)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="hq-bench-selection-")
    try:
        variants: list[Variant] = [
            Old(os.path.join(base, "old")),
            New("no keys", os.path.join(base, "plain"), keys=False),
            New("10k keys", os.path.join(base, "keys"), keys=True),
            New("10k keys, fair", os.path.join(base, "fair"), keys=True, fair=True),
            New("10k keys, gate", os.path.join(base, "gate"), keys=True, gate=True),
        ]
        for v in variants:
            v.add(0, args.rows)
        adds: dict[str, list[float]] = {v.name: [] for v in variants}
        takes: dict[str, list[float]] = {v.name: [] for v in variants}
        next_id = args.rows
        for r in range(args.rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for v in order:
                adds[v.name].append(timed(lambda v=v, at=next_id: v.add(at, args.batch)) / args.batch * 1e6)
                got = 0

                def take(v: Variant = v) -> None:
                    nonlocal got
                    got = v.take(args.batch)

                took = timed(take)
                takes[v.name].append(took / max(got, 1) * 1e6)
            next_id += args.batch
        for v in variants:
            v.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    ref_add, ref_take = statistics.median(adds["before"]), statistics.median(takes["before"])
    print(f"run table selection, {args.rows:,} waiting, {args.batch:,} per round, {args.rounds} rounds")
    print(f"{'variant':<16} {'index us/job':>13} {'x before':>9} {'pick+delete us/job':>19} {'x before':>9}")
    figures = {}
    for name, added in adds.items():
        a, t = statistics.median(added), statistics.median(takes[name])
        figures[name] = {"add_us": round(a, 2), "take_us": round(t, 2)}
        print(f"{name:<16} {a:>13.1f} {a / ref_add:>8.2f}x {t:>19.1f} {t / ref_take:>8.2f}x")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
