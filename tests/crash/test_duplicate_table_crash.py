"""Pending duplicates under SIGKILL: each settles with its owner's outcome exactly once, never runs.

A child forwarder admits 120 jobs with one explicit idempotency key, ten per step: the first
owns it, the others are recorded as its duplicates (rows of the key table's ``duplicates``
table: ``hybridq.ledger.duptable``), its ledger index saved every step. It is SIGKILLed between
a ledger append and the table's commit, between the table's mark and the saved index, or right
after a save; or it ends cleanly and the table is then deleted or damaged (the saved index no
longer fits it: a full replay rebuilds it). The parent starts a fresh forwarder (Redis lost
everything too), which pushes the owner alone; once the owner has run, every duplicate is
settled with its outcome, once (docs/reliability.md, "The key table").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq.ledger.store import read_ledger
from hybridq.transport import MemoryTransport

from tests.crash.test_key_table_crash import SCENARIOS, _written, child, crashed_or_lost
from tests.unit.test_completions import make_forwarder, settle

CHILD = child(key="one-key")


@pytest.mark.parametrize(("point", "damage"), SCENARIOS)
def test_a_crash_or_a_lost_table_settles_each_duplicate_once(
    tmp_path: Path, point: str | None, damage: str | None, figures: Callable[[str], None]
) -> None:
    journal = tmp_path / "journal"
    table = crashed_or_lost(CHILD, journal, point, damage)
    if table is not None:
        table.close()
    owner, *dups = _written(journal)
    assert dups
    transport = MemoryTransport()
    forwarder = make_forwarder(journal, transport)
    try:
        settle(forwarder)
        assert list(transport.jobs) == [owner.id]  # the duplicates wait, never pushed
        pending = forwarder.state.index.duplicates
        assert sorted(e.job_id for e in pending.values()) == sorted(d.id for d in dups)
        transport.work()
        settle(forwarder)
        assert len(forwarder.state.index.duplicates) == 0
        settle(forwarder)
    finally:
        forwarder.close()
    assert transport.executions == {owner.id: 1}
    settled = Counter(
        (e.job_id, e.outcome)
        for _, e in read_ledger(str(journal))
        if e.kind == "done" and e.dup_of == owner.id
    )
    assert settled == {(d.id, "succeeded"): 1 for d in dups}
    figures(f"duplicate table crash={point or damage} duplicates={len(dups)} settled_once={len(settled)}")
