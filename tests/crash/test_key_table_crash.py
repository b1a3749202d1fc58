"""The key table under SIGKILL: no idempotency key's owner is lost, so no duplicate is ever pushed.

A child forwarder admits jobs with explicit idempotency keys, ten per step, saving its ledger
index every step (``SAVE_EVERY`` lowered: the key table is marked each time), and SIGKILLs
itself between a ledger append and the table's commit (``keys_before_commit``), between the
table's mark and the saved index (``index_keys_marked``), or right after a save; or it ends
cleanly and the table is then deleted or damaged. The parent starts a fresh forwarder on the
journal: every key written has its first job as owner, and a second job with each key is
recorded as a duplicate and never pushed (docs/reliability.md, "The key table").
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.envelope.model import Envelope
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalReader, JournalWriter
from hybridq.ledger import saved_index
from hybridq.ledger.keytable import KEYS_TABLE_FILE, KeyTable
from hybridq.ledger.store import read_ledger
from hybridq.transport import MemoryTransport

from tests.crash.test_s13_compaction_crash import killed_at

STEPS = 12


def child(key: str = "", each_step: str = "") -> str:
    """A forwarder's script: ``STEPS`` steps of ten jobs, ``key`` their keys' f-string (none if
    empty), ``each_step`` code run after each step (indented 8, ``start`` the first job's number),
    its ledger index saved every 7 entries."""
    keyed = f'idempotency_key=f"{key}", ' if key else ""
    return f"""
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
            queue.prepare("tests.tasks.add", (i, i), {keyed}job_id=f"job-{{i}}").to_bytes()
            for i in range(start, start + 10)
        )
        forwarder.step()
{each_step}
forwarder.close()
"""


CHILD = child(key="key-{i}")


def _written(journal: Path) -> list[Envelope]:
    return [Envelope.from_bytes(r.payload) for r in JournalReader(str(journal)).records()]


#: Where the child is SIGKILLed (a crash point), or how its table is lost after a clean end.
SCENARIOS = [
    ("keys_before_commit:5", None),
    ("index_keys_marked:4", None),
    ("index_after_save:4", None),
    (None, "deleted"),
    (None, "garbage"),
]


def crashed_or_lost(child: str, journal: Path, point: str | None, damage: str | None) -> KeyTable | None:
    """Run ``child`` on ``journal``: killed at ``point``, or to its end and its table then lost.

    After a crash, the table as the saved index trusts it (checked), open; else ``None``.
    """
    if point is not None:
        killed_at(point, child, journal)
        saved = saved_index.load(str(journal))
        assert saved is not None
        table = KeyTable(str(journal / KEYS_TABLE_FILE))
        assert table.trusts(*saved.keys_table)
        return table
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    subprocess.run([sys.executable, "-c", child, str(journal)], env=env, check=True, timeout=120)
    path = journal / KEYS_TABLE_FILE
    for suffix in ("-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    if damage == "deleted":
        path.unlink()
    else:
        path.write_bytes(b"garbage" * 1000)
    return None


@pytest.mark.parametrize(("point", "damage"), SCENARIOS)
def test_a_crash_or_a_lost_table_loses_no_key_owner(
    tmp_path: Path, point: str | None, damage: str | None, figures: Callable[[str], None]
) -> None:
    journal = tmp_path / "journal"
    table = crashed_or_lost(CHILD, journal, point, damage)
    originals = _written(journal)
    assert originals
    if table is not None:  # the crash left the table trusted by the saved index, as meant
        assert point is not None
        saved = saved_index.load(str(journal))
        assert saved is not None
        if point.startswith("keys_before_commit"):  # owners in the ledger, not in the table
            assert len(table) < len(originals)
        if point.startswith("index_keys_marked"):  # the table ahead of the saved index
            assert table.generation > saved.keys_table[1]
        table.close()

    transport = MemoryTransport()  # Redis lost everything as well
    forwarder = Forwarder(str(journal), transport, reconcile_interval_s=0.0, lease_s=0.0)
    forwarder.open()
    try:
        keys = forwarder.state.index.keys
        for env in originals:
            owner = keys.get(env.key_id)
            assert owner is not None, env.id
            assert owner.job_id == env.id
        queue = Queue(journal=str(journal))
        with JournalWriter(str(journal)) as writer:
            writer.append_many(
                queue.prepare(
                    "tests.tasks.add", (0, 0), idempotency_key=f"key-{n}", job_id=f"again-{n}"
                ).to_bytes()
                for n in range(len(originals))
            )
        for _ in range(5):
            forwarder.step()
        assert not [job_id for job_id in transport.jobs if job_id.startswith("again-")]
    finally:
        forwarder.close()
    duplicates = {e.job_id for _, e in read_ledger(str(journal)) if e.kind == "duplicate"}
    assert duplicates == {f"again-{n}" for n in range(len(originals))}
    figures(f"key table crash={point or damage} keyed_jobs={len(originals)} duplicates_pushed=0")
