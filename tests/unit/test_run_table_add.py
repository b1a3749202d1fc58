"""The run table's insert of a batch: one statement for the batch, row by row when some were there.

``RunTable.add`` keeps the per-queue and per-priority counts (what a start reads instead of the
rows) and the rows a refusal put back true in each case: a batch all new, a batch read again
after a crash (some rows there already), and a batch whose insert fails part-way (docs/forwarder.md,
"The window"; docs/reliability.md, "The run table").
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hybridq.errors import JournalIOError
from hybridq.forwarder.runs import Row, RunTable


def _rows(first: int, n: int, prio: int = 0) -> list[Row]:
    return [(("w", 0, 64 + 100 * i), "default", 1.0 + i, prio, "") for i in range(first, first + n)]


def _stored(runs: RunTable) -> dict[tuple[str, int], int]:
    got = runs.db.execute("SELECT queue, prio, count(*) FROM runs GROUP BY queue, prio").fetchall()
    return {(q, p): n for q, p, n in got}


def test_a_new_batch_is_counted_once_per_row(tmp_path: Path) -> None:
    runs = RunTable(str(tmp_path))
    runs.open()
    try:
        runs.add(_rows(0, 5) + _rows(5, 3, prio=2))
        assert runs.counts == {"default": 8}
        assert runs.prios == {"default": {0: 5, 2: 3}}
        assert _stored(runs) == {("default", 0): 5, ("default", 2): 3}
    finally:
        runs.close()


def test_a_batch_read_again_counts_only_its_new_rows_and_keeps_the_rows_put_back(tmp_path: Path) -> None:
    runs = RunTable(str(tmp_path))
    runs.open()
    try:
        runs.add(_rows(0, 4))
        runs.commit()
        # Rows 2..5: two there already (kept as they were), two new, one of them put back.
        again = _rows(2, 4)
        runs.add(again, [0, 0, 0, 3])
        assert runs.counts == {"default": 6}
        assert runs.prios == {"default": {0: 6}}
        assert runs.backs == {("w", 0, 64 + 100 * 5): 3}
        assert _stored(runs) == {("default", 0): 6}
        runs.commit()
        runs.rollback()  # the counts read back from the file: the same
        assert runs.counts == {"default": 6}
        assert runs.backs == {("w", 0, 64 + 100 * 5): 3}
    finally:
        runs.close()


def test_a_batch_that_fails_part_way_adds_none_of_its_rows(tmp_path: Path) -> None:
    runs = RunTable(str(tmp_path))
    runs.open()
    try:
        runs.add(_rows(0, 2))
        bad: list[Row] = [*_rows(2, 3), (("w", 0, 9999), "default", 1.0, 0, object())]  # type: ignore[list-item]
        with pytest.raises(JournalIOError):
            runs.add(bad)
        assert runs.counts == {"default": 2}
        assert _stored(runs) == {("default", 0): 2}
        runs.commit()  # what the failed call began is not committed with the rest
        runs.rollback()
        assert runs.counts == {"default": 2}
    finally:
        runs.close()
