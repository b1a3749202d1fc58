"""Pending duplicates under SIGKILL: each settles with its owner's outcome exactly once, never runs.

A child forwarder admits 120 jobs with one explicit idempotency key, ten per step: the first
owns it, the others are recorded as its duplicates (rows of the key table's ``duplicates``
table: ``hybridq.ledger.duptable``), its ledger index saved every step. It is SIGKILLed between
a ledger append and the table's commit, between the table's mark and the saved index, or right
after a save (its owner still pending, or, killed at later steps, after it ran at the sixth);
or it ends cleanly and the table is then deleted or damaged (the saved index no
longer fits it: a full replay rebuilds it). The parent starts a fresh forwarder (Redis lost
everything too), which pushes the owner alone; once the owner has run, every duplicate is
settled with its outcome, once (docs/reliability.md, "The key table").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq.forwarder.upkeep import Upkeep
from hybridq.ledger.store import read_ledger
from hybridq.transport import MemoryTransport

from tests.crash.test_key_table_crash import SCENARIOS, _written, child, crashed_or_lost
from tests.unit.test_completions import make_forwarder, settle

CHILDREN = {
    "owner pending": child(key="one-key"),
    # The owner runs at the sixth step: the kill may come before or after its outcome is
    # harvested, before or after its duplicates' settling is appended or marked.
    "owner finishes": child(
        key="one-key",
        each_step="""
        if start == 50:
            forwarder.transport.work()""",
    ),
}


#: Kills after the owner ran (its outcome harvested at the sixth step or the next ones).
LATE = [(f"{point}:{n}", None) for point in ("keys_before_commit", "index_keys_marked") for n in (7, 8, 9)]


@pytest.mark.parametrize(
    ("story", "point", "damage"),
    [(story, *scenario) for story in sorted(CHILDREN) for scenario in SCENARIOS]
    + [("owner finishes", *scenario) for scenario in LATE],
)
def test_a_crash_or_a_lost_table_settles_each_duplicate_once(
    tmp_path: Path,
    point: str | None,
    damage: str | None,
    story: str,
    figures: Callable[[str], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(Upkeep, "compact", lambda _self: False)  # every settling stays in the ledger
    journal = tmp_path / "journal"
    table = crashed_or_lost(CHILDREN[story], journal, point, damage)
    if table is not None:
        table.close()
    owner, *dups = _written(journal)
    assert dups
    transport = MemoryTransport()
    forwarder = make_forwarder(journal, transport)
    try:
        settle(forwarder)
        assert set(transport.jobs) <= {owner.id}  # the duplicates wait, never pushed
        if story == "owner pending":
            assert list(transport.jobs) == [owner.id]
            pending = forwarder.state.index.duplicates
            assert sorted(e.job_id for e in pending.values()) == sorted(d.id for d in dups)
        transport.work()
        settle(forwarder)
        assert len(forwarder.state.index.duplicates) == 0
        settle(forwarder)
    finally:
        forwarder.close()
    assert set(transport.executions) <= {owner.id}
    ran = [e.job_id for _, e in read_ledger(str(journal)) if e.kind == "done" and e.dup_of is None]
    assert not set(ran) & {d.id for d in dups}  # every duplicate's outcome is a settling
    settled = Counter(
        (e.job_id, e.outcome)
        for _, e in read_ledger(str(journal))
        if e.kind == "done" and e.dup_of == owner.id
    )
    assert settled == {(d.id, "succeeded"): 1 for d in dups}
    figures(
        f"duplicate table {story} crash={point or damage} duplicates={len(dups)} settled_once={len(settled)}"
    )
