"""The forwarder's start holds its index under ``index_offsets_max`` from the load on (issue 29).

``ForwarderState.load`` passes the cap to :func:`~hybridq.ledger.saved_index.resume`: the saved
index's maps are spilled as its segments are read, and a replay of the whole ledger (no saved
index) spills as it goes. Its ``spill_past`` after ``collapse_punched`` would give the same
answers without it, but only after the start held the whole index (106.7 MB at 2M jobs,
docs/forwarder.md, "Memory"): these tests look at the index when ``collapse_punched`` gets it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hybridq.forwarder import state as forwarder_state
from hybridq.forwarder.state import ForwarderConfig, ForwarderState
from hybridq.ledger import saved_index, store
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.store import load_index, open_ledger_writer, replay

from tests.unit import test_ledger_replay

CAP, SEGMENTS, PER_SEGMENT = 2000, 12, 3000


def ledger_of_finished_jobs(tmp_path: Path) -> str:
    """A journal whose ledger holds 36,000 succeeded jobs in 12 segments of one chain."""
    journal, chain = test_ledger_replay.journal_of_three_segments(tmp_path)
    with open_ledger_writer(journal) as writer:
        for s in range(SEGMENTS):
            writer.append_many(
                Entry("done", f"j{s}-{i}", (chain, s, 4096 + 300 * i), outcome="succeeded", at=1.0).to_bytes()
                for i in range(PER_SEGMENT)
            )
    return journal


def start_and_look(journal: str, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], LedgerIndex]:
    """A forwarder start under ``index_offsets_max=CAP``: what its index was at collapse_punched."""
    seen: dict[str, Any] = {}
    real_resume, real_collapse = forwarder_state.resume, forwarder_state.collapse_punched

    def resume(*args: Any) -> Any:
        seen["resumed"] = (out := real_resume(*args))[2]
        return out

    def collapse_punched(journal: str, index: LedgerIndex, compacted: Compacted) -> None:
        seen["spilled"] = sum(done.spilled for done in index.terminal.values())
        seen["resident"] = sum(done.resident() for done in index.terminal.values())
        real_collapse(journal, index, compacted)

    monkeypatch.setattr(forwarder_state, "resume", resume)
    monkeypatch.setattr(forwarder_state, "collapse_punched", collapse_punched)
    started = ForwarderState(journal, ForwarderConfig(index_offsets_max=CAP))
    started.load()
    try:
        assert started.index == load_index(journal, Compacted())
        return seen, started.index
    finally:
        started.close()


def test_a_start_with_a_saved_index_spills_it_as_it_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = ledger_of_finished_jobs(tmp_path)
    index = LedgerIndex(keys=KeyTable.in_journal(journal))
    saved_index.save(journal, index, replay(journal, index, Compacted()), {})
    index.keys.close()
    seen, _ = start_and_look(journal, monkeypatch)
    assert seen["resumed"] == 1  # from the saved index
    assert seen["spilled"] >= SEGMENTS // 2, seen
    assert seen["resident"] <= CAP + PER_SEGMENT * 2, seen  # the cap and the drain front, not 36,000


def test_a_start_without_a_saved_index_spills_during_the_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store, "SPILL_CHECK_RECORDS", 64)
    journal = ledger_of_finished_jobs(tmp_path)
    seen, _ = start_and_look(journal, monkeypatch)
    assert seen["resumed"] == 0  # the whole ledger replayed
    assert seen["spilled"] >= SEGMENTS // 2, seen
    assert seen["resident"] <= CAP + PER_SEGMENT * 2, seen
