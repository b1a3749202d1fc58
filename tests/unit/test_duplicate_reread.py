"""A job read again after a crash is recorded as a duplicate once, against one owner.

Run 1 records D as a duplicate of A; A fails; the run is killed before D's settle and before
the checkpoint passes D. A requeue A2 takes the key over; run 2 (a new ledger chain) reads D
again. A second ``duplicate`` entry (``ol`` = A2) made D's outcome depend on whether the table
survived: a full replay applies the chains in the order of their random ids, and the row kept
whichever came first. Now the re-read writes nothing, and the table keeps
the earlier of two entries, by (at, ol), in any order (docs/reliability.md, "Duplicates").
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
from hybridq.forwarder.admission import Admission
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.keytable import KEYS_TABLE_FILE
from hybridq.ledger.store import read_ledger

from tests.unit import test_failure_table, test_ledger_replay
from tests.unit.test_duplicate_owner import _env, _loaded

Loc = tuple[str, int, int]


def _restart(journal: str, dup: Loc, lose_table: bool) -> tuple[str | None, bool]:
    if lose_table:
        os.unlink(os.path.join(journal, KEYS_TABLE_FILE))
    state = _loaded(journal)
    try:
        Admission(state).settle()
        return state.index.outcome(dup), dup in state.index.duplicates
    finally:
        state.close()


@pytest.mark.parametrize("attempt", range(3))  # the chains' ids are random: both orders show up
def test_a_reread_duplicate_follows_one_owner_whether_the_table_survived(
    tmp_path: Path, attempt: int
) -> None:
    """Fails before: run 2 wrote a second entry (and in about a third of the runs, the rebuilt
    table waited for A2 while the trusted one settled D ``failed``)."""
    journal, writer = test_ledger_replay.journal_of_three_segments(tmp_path)
    dup = (writer, 1, 32)
    state = _loaded(journal)
    adm = Admission(state)
    assert adm.admit(_env("A", "k"), (writer, 0, 32))
    adm.flush()
    assert not adm.admit(_env("D", "k"), dup)
    adm.flush()
    state.append([Entry("done", "A", (writer, 0, 32), outcome="failed", at=1.0)])
    state.close()
    state = _loaded(journal)
    adm = Admission(state)
    assert adm.admit(_env("A", "k", requeue=1), (writer, 2, 32))
    assert not adm.admit(_env("D", "k"), dup)  # not pushed, and not recorded again
    state.append(adm._entries)
    adm.reset()
    state.close()
    owners = [e.owner_loc for _, e in read_ledger(journal) if e.kind == "duplicate"]
    assert owners == [(writer, 0, 32)]
    copy = str(tmp_path / "copy")
    shutil.copytree(journal, copy)
    assert _restart(journal, dup, lose_table=False) == ("failed", False)
    assert _restart(copy, dup, lose_table=True) == ("failed", False)


@pytest.mark.parametrize("on_disk", [False, True])
@pytest.mark.parametrize(("first", "second"), [(1.0, 2.0), (1.0, 1.0)])
def test_two_duplicate_entries_of_one_job_keep_the_earlier_in_any_order(
    tmp_path: Path, on_disk: bool, first: float, second: float
) -> None:
    """Fails before: the row kept whichever entry was applied first (INSERT OR IGNORE)."""
    loc: Loc = ("w", 1, 32)
    early = Entry("duplicate", "D", loc, key="k", dup_of="A", owner_loc=("w", 0, 32), at=first, queue="q")
    late = Entry("duplicate", "D", loc, key="k", dup_of="A2", owner_loc=("w", 2, 32), at=second, queue="q")

    def check(index: LedgerIndex) -> None:
        assert len(index.duplicates) == 1
        assert index.duplicates.get(loc) == early
        assert [(r, owner) for r, _, owner in index.duplicates.of_owners([("w", 0, 32), ("w", 2, 32)])] == [
            (loc, ("w", 0, 32))
        ]

    for seed in range(4):  # three shuffles each: both orders come up
        (tmp_path / str(seed)).mkdir()
        test_failure_table.in_three_orders(
            tmp_path / str(seed), random.Random(seed), [late, early], on_disk, check
        )
