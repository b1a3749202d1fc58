"""The listed failures under SIGKILL: none lost, none requeued or outranked brought back (issue 29).

The forwarder keeps the failures listed for ``hybridq failed requeue`` as rows of
``<journal>/ledger-keys.sqlite`` (``hybridq.ledger.failtable``), under the key table's rules
(docs/reliability.md, "The key table"). A child forwarder records failures through its own
ledger path, ten jobs per step, with a requeue mark after some, one before others (replay order
across chains is not global: the mark may be read first), and a success after others (a worker
that reported after the forwarder gave up on it); it saves its index every few entries
(``SAVE_EVERY`` lowered) and SIGKILLs itself between a ledger append and the table's commit,
between the table's mark and the saved index, or right after a save; or it ends cleanly and
the table is then deleted or damaged. A fresh forwarder lists exactly what the ledger says, as
``hybridq failed list`` (which replays the ledger into memory) does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq.forwarder.loop import Forwarder
from hybridq.ledger.store import read_ledger
from hybridq.ops.failures import failed_jobs
from hybridq.transport import MemoryTransport

from tests.crash.test_key_table_crash import SCENARIOS, child, crashed_or_lost

CHILD = child(
    each_step="""
        for r in list(JournalReader(journal).records())[start:start + 10]:
            env = Envelope.from_bytes(r.payload)
            i, loc = int(env.id[4:]), (r.writer_id, r.segment_index, r.offset)
            failed = Entry("done", env.id, loc, outcome="failed", error="boom", at=float(i), job=env.to_dict())
            mark = Entry("requeued", env.id, loc, at=float(i))
            won = Entry("done", env.id, loc, outcome="succeeded", at=float(i) + 1)
            steps = {1: [[failed], [mark]], 2: [[failed], [won]], 3: [[mark], [failed]]}.get(i % 5, [[failed]])
            for entries in steps:
                forwarder.state.append(entries)
        forwarder.step()"""
)


def _listed_by_the_ledger(journal: Path) -> set[str]:
    """Failed, then neither requeued nor outranked by a success, in any order: the reference."""
    failed, gone = set(), set()
    for _, e in read_ledger(str(journal)):
        if e.kind == "done" and e.outcome == "failed":
            failed.add(e.job_id)
        elif e.kind == "requeued" or (e.kind == "done" and e.outcome == "succeeded"):
            gone.add(e.job_id)
    return failed - gone


@pytest.mark.parametrize(("point", "damage"), SCENARIOS)
def test_a_crash_or_a_lost_table_keeps_the_failures_listed(
    tmp_path: Path, point: str | None, damage: str | None, figures: Callable[[str], None]
) -> None:
    journal = tmp_path / "journal"
    table = crashed_or_lost(CHILD, journal, point, damage)  # trusted after a crash, as meant
    expected = _listed_by_the_ledger(journal)
    assert expected
    if table is not None:
        if point == "keys_before_commit:5":  # failures in the ledger, not in the table
            assert len(table.failures) < len(expected)
        table.close()
    forwarder = Forwarder(str(journal), MemoryTransport(), reconcile_interval_s=0.0, lease_s=0.0)
    forwarder.open()
    try:
        listed = {e.job_id for e in forwarder.state.index.failed.values()}
        assert len(forwarder.state.index.failed) == len(listed)
        forwarder.step()
    finally:
        forwarder.close()
    assert listed == expected
    assert {f.id for f in failed_jobs(str(journal))} == expected  # the reader's replay agrees
    assert all(int(job_id[4:]) % 5 in (0, 4) for job_id in listed)
    figures(f"failure table crash={point or damage} listed={len(listed)} lost=0 resurrected=0")
