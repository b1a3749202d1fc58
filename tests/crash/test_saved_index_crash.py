"""The saved ledger index under SIGKILL: a start never trusts more than the ledger holds.

A child forwards jobs through the in-memory transport, runs them, harvests and compacts, saving
its ledger index every few entries (``SAVE_EVERY`` lowered), and SIGKILLs itself while the index
file is half written (``index_mid_write``), right after it was replaced (``index_after_save``),
or between a ledger append and the next save (``harvest_after_ledger``). The parent then starts a
fresh forwarder on the journal: its index must be the full replay's (``load_index``), no job the
ledger recorded as finished is delivered again, every job runs, and the status counts are exact.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq.ledger import saved_index
from hybridq.ledger.compacted import load_compacted
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.punched_maps import collapse_punched
from hybridq.ledger.store import load_index

from tests.crash.test_s13_compaction_crash import CHILD_START, killed_at, restart_and_drain

JOBS = 300

CHILD = (
    CHILD_START.format(
        jobs=JOBS, segment=16384, setup="from hybridq.ledger import saved_index\nsaved_index.SAVE_EVERY = 7"
    )
    + """
for _ in range(30):
    transport.work(limit=10)
    forwarder.completions.hurry()
    forwarder.step()
forwarder.close()
"""
)


@pytest.mark.parametrize(
    ("point", "nth"),
    [("index_mid_write", 60), ("index_after_save", 8), ("harvest_after_ledger", 12)],
)
def test_a_crash_while_the_index_is_saved_or_after_trusts_only_the_ledger(
    tmp_path: Path, point: str, nth: int, figures: Callable[[str], None]
) -> None:
    journal = tmp_path / "journal"
    killed_at(f"{point}:{nth}", CHILD, journal)
    compacted_before = load_compacted(str(journal))
    finished_before = load_index(str(journal), compacted_before)
    _, _, resumed = saved_index.resume(str(journal), compacted_before, KeyTable.in_journal(str(journal)))
    assert resumed > 0  # the index saved before the crash is whole, and used

    # The start's index (ForwarderState.load resumes as this does, then applies the hole maps:
    # the punched ranges instead of their succeeded jobs) is the full replay's.
    started = saved_index.resume(str(journal), compacted_before, KeyTable.in_journal(str(journal)))[0]
    collapse_punched(str(journal), started, compacted_before)
    replayed = load_index(str(journal), compacted_before)
    collapse_punched(str(journal), replayed, compacted_before)
    assert started == replayed
    assert {seg: done.punched() for seg, done in started.terminal.items()} == {
        seg: done.punched() for seg, done in replayed.terminal.items()
    }
    redelivered = restart_and_drain(journal, finished_before, compacted_before, JOBS)
    figures(
        f"saved index crash={point}:{nth} chains_resumed={resumed} "
        f"finished_before={finished_before.terminal_count} redelivered={redelivered} lost=0"
    )
