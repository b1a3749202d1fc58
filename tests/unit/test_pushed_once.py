"""A job pushed and finished between two writes of the pushed list: its row written once.

In a burn most jobs finish within the list's write interval (``FLUSH_EVERY_S``): the flush
wrote an insert and then an update marking it finished, two writes of one row in one commit.
It now writes the row finished (docs/benchmarks.md, "Fewer writes per job"); the rows on disk
are the same (fails before: an ``UPDATE`` per such job).
"""

from __future__ import annotations

import time
from pathlib import Path

from hybridq.forwarder.pushed import PushedJobs
from hybridq.forwarder.runs import RunTable


def _opened(path: Path) -> tuple[RunTable, PushedJobs, list[str]]:
    runs = RunTable(str(path))
    runs.open()
    pushed = PushedJobs(runs, recent=100)
    pushed.open(str(path), {}, _NoLedger())  # type: ignore[arg-type]
    statements: list[str] = []
    runs.db.set_trace_callback(statements.append)
    return runs, pushed, statements


class _NoLedger:
    duplicates: frozenset[object] = frozenset()

    def is_terminal(self, loc: object) -> bool:
        return False


def _rows(runs: RunTable) -> dict[tuple[str, int, int], tuple[int, bool]]:
    got = runs.db.execute("SELECT chain, seg, off, at, done FROM pushed").fetchall()
    return {(c, s, o): (int(at), done > 0) for c, s, o, at, done in got}


def test_a_job_pushed_and_finished_in_one_interval_is_written_once_finished(tmp_path: Path) -> None:
    runs, pushed, statements = _opened(tmp_path)
    try:
        seq = pushed.seq
        pushed.add([("w", 0, 64), ("w", 0, 164), ("w", 0, 264)])
        pushed.done(("w", 0, 64))
        pushed.done(("w", 0, 164))
        statements.clear()
        pushed.flush({})
        assert not [s for s in statements if s.startswith("UPDATE pushed")]
        assert _rows(runs) == {
            ("w", 0, 64): (seq, True),
            ("w", 0, 164): (seq, True),
            ("w", 0, 264): (seq, False),
        }
        assert pushed.count() == 1
    finally:
        runs.close()


def test_a_row_on_disk_pushed_again_and_finished_keeps_its_interval_and_is_marked(tmp_path: Path) -> None:
    runs, pushed, _ = _opened(tmp_path)
    try:
        first = pushed.seq
        pushed.insert([("w", 0, 64)])  # pushed from the run table: written at once
        runs.commit()
        pushed.cut()
        pushed.add([("w", 0, 64), ("w", 0, 164)])  # a copy pushed again (a refill), then both finished
        pushed.done(("w", 0, 64))
        pushed.done(("w", 0, 164))
        time.sleep(0.001)
        pushed.flush({})
        rows = _rows(runs)
        assert rows[("w", 0, 64)] == (first, True)
        assert rows[("w", 0, 164)][1]
        assert not pushed.listed(("w", 0, 64))
        assert pushed.count() == 0
    finally:
        runs.close()
