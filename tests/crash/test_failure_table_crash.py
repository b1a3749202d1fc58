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

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq.forwarder.loop import Forwarder
from hybridq.ledger import saved_index
from hybridq.ledger.keytable import KEYS_TABLE_FILE, KeyTable
from hybridq.ledger.store import read_ledger
from hybridq.ops.failures import failed_jobs
from hybridq.transport import MemoryTransport

from tests.crash.test_s13_compaction_crash import killed_at

STEPS = 12

CHILD = f"""
import sys
from hybridq import Queue
from hybridq.envelope.model import Envelope
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalReader, JournalWriter
from hybridq.ledger import saved_index
from hybridq.ledger.entries import Entry
from hybridq.transport import MemoryTransport
saved_index.SAVE_EVERY = 7
journal = sys.argv[1]
queue = Queue(journal=journal)
forwarder = Forwarder(journal, MemoryTransport(), reconcile_interval_s=0.0, lease_s=0.0)
forwarder.open()
with JournalWriter(journal) as writer:
    for start in range(0, {STEPS * 10}, 10):
        writer.append_many(
            queue.prepare("tests.tasks.add", (i, i), job_id=f"job-{{i}}").to_bytes()
            for i in range(start, start + 10)
        )
        forwarder.step()
        for r in list(JournalReader(journal).records())[start:start + 10]:
            env = Envelope.from_bytes(r.payload)
            i, loc = int(env.id[4:]), (r.writer_id, r.segment_index, r.offset)
            failed = Entry("done", env.id, loc, outcome="failed", error="boom", at=float(i), job=env.to_dict())
            mark = Entry("requeued", env.id, loc, at=float(i))
            won = Entry("done", env.id, loc, outcome="succeeded", at=float(i) + 1)
            steps = {{1: [[failed], [mark]], 2: [[failed], [won]], 3: [[mark], [failed]]}}.get(i % 5, [[failed]])
            for entries in steps:
                forwarder.state.append(entries)
        forwarder.step()
forwarder.close()
"""


def _listed_by_the_ledger(journal: Path) -> set[str]:
    """Failed, then neither requeued nor outranked by a success, in any order: the reference."""
    failed, gone = set(), set()
    for _, e in read_ledger(str(journal)):
        if e.kind == "done" and e.outcome == "failed":
            failed.add(e.job_id)
        elif e.kind == "requeued" or (e.kind == "done" and e.outcome == "succeeded"):
            gone.add(e.job_id)
    return failed - gone


@pytest.mark.parametrize(
    ("point", "damage"),
    [
        ("keys_before_commit:5", None),
        ("index_keys_marked:4", None),
        ("index_after_save:4", None),
        (None, "deleted"),
        (None, "garbage"),
    ],
)
def test_a_crash_or_a_lost_table_keeps_the_failures_listed(
    tmp_path: Path, point: str | None, damage: str | None, figures: Callable[[str], None]
) -> None:
    journal = tmp_path / "journal"
    if point is not None:
        killed_at(point, CHILD, journal)
    else:
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        subprocess.run([sys.executable, "-c", CHILD, str(journal)], env=env, check=True, timeout=120)
        table = journal / KEYS_TABLE_FILE
        for suffix in ("-wal", "-shm"):
            Path(str(table) + suffix).unlink(missing_ok=True)
        if damage == "deleted":
            table.unlink()
        else:
            table.write_bytes(b"garbage" * 1000)
    expected = _listed_by_the_ledger(journal)
    assert expected
    if point is not None:  # the crash left the table trusted by the saved index, as meant
        saved = saved_index.load(str(journal))
        assert saved is not None
        table = KeyTable(str(journal / KEYS_TABLE_FILE))
        assert table.trusts(*saved.keys_table)
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
