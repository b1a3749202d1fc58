"""The saved ledger index under SIGKILL: a start never trusts more than the ledger holds.

A child forwards jobs through the in-memory transport, runs them, harvests and compacts, saving
its ledger index every few entries (``SAVE_EVERY`` lowered), and SIGKILLs itself while the index
file is half written (``index_mid_write``), right after it was replaced (``index_after_save``),
or between a ledger append and the next save (``harvest_after_ledger``). Its first job is delayed
and its segments small, as in test_punch_crash: that job pins its chain, so the compactor punches
the finished records of the segments behind it and the saved index (format 5 on) holds their
ranges when the child dies. Format 6 is written in pieces (room for the header, its first line,
a line per segment, then the header at offset 0), each write halved by the crash ops: the
``index_mid_write`` points cut each of these in the second save (the temp file left shows which).
The parent then starts a fresh forwarder on the journal: its index
must be the full replay's (``load_index``) with the hole maps applied, no job the ledger recorded
as finished is delivered again, every job runs, and the status counts are exact.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq.envelope.model import Envelope
from hybridq.journal import JournalReader
from hybridq.journal.holes import HOLES_SUFFIX
from hybridq.ledger import saved_index
from hybridq.ledger.compacted import load_compacted
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.punched_maps import collapse_punched
from hybridq.ledger.store import load_index

from tests.crash.test_s13_compaction_crash import killed_at, restart_and_drain

JOBS = 300
#: The first job's delay: it stays unfinished (pinning its chain) until the child is killed,
#: about 0.3 s after writing it (0.5 s the whole child, measured unloaded); the parent waits for
#: it to be due before it drains.
DELAY_S = 1.5

CHILD = f"""
import sys
from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalWriter
from hybridq.ledger import saved_index
from hybridq.transport import MemoryTransport
saved_index.SAVE_EVERY = 7
journal = sys.argv[1]
queue = Queue(journal=journal)
with JournalWriter(journal, max_segment_bytes=4096) as writer:
    writer.append_many([queue.prepare("tests.tasks.add", (0, 0), delay={DELAY_S}).to_bytes()])
    for start in range(1, {JOBS}, 10):
        writer.append_many(
            queue.prepare("tests.tasks.add", (i, i)).to_bytes() for i in range(start, min(start + 10, {JOBS}))
        )
transport = MemoryTransport()
forwarder = Forwarder(journal, transport, reconcile_interval_s=0.0, lease_s=0.0, max_lost=100)
forwarder.open()
forwarder.step()
for _ in range(30):
    transport.work(limit=10)
    forwarder.completions.hurry()
    forwarder.completions.compactor.hurry()
    forwarder.step()
forwarder.close()
"""


#: A state file's header: magic, version, reserved, length, CRC (docs/journal-format.md).
HEADER = 20


def _cut(temp: bytes) -> str:
    """Which write of a format 6 save the temp file left by a crash shows cut."""
    if len(temp) < HEADER:
        return "room for the header"
    if temp[:HEADER] != bytes(HEADER):
        return "the header"
    lines = temp[HEADER:].count(b"\n")
    return "the first line" if lines == 0 else "a segment line"


@pytest.mark.parametrize(
    ("point", "nth", "cut"),
    # The writes of the child's second save (the first, whole, is what the start resumes from),
    # counted when this was written (crash ops halve each write: 6 writes fill 20 bytes):
    # 29 to 34 room for the header, 35 to 43 the first line, 44 to 57 two segment lines, 58 to
    # 63 the header at offset 0. _cut checks the temp file left is the one named.
    [
        ("index_mid_write", 30, "room for the header"),
        ("index_mid_write", 37, "the first line"),
        ("index_mid_write", 52, "a segment line"),
        ("index_mid_write", 60, "the header"),
        ("index_after_save", 8, ""),
        ("harvest_after_ledger", 12, ""),
    ],
)
def test_a_crash_while_the_index_is_saved_or_after_trusts_only_the_ledger(
    tmp_path: Path, point: str, nth: int, cut: str, figures: Callable[[str], None]
) -> None:
    journal = tmp_path / "journal"
    killed_at(f"{point}:{nth}", CHILD, journal)
    if cut:
        assert _cut((journal / (saved_index.SAVED_INDEX_NAME + ".state.tmp")).read_bytes()) == cut
    assert any(HOLES_SUFFIX in name for name in os.listdir(journal))  # the compactor punched
    compacted_before = load_compacted(str(journal))
    finished_before = load_index(str(journal), compacted_before)
    saved, _, resumed = saved_index.resume(str(journal), compacted_before, KeyTable.in_journal(str(journal)))
    assert resumed > 0  # the index saved before the crash is whole, and used
    # The case under test: the saved index (format 5 on) holds punched ranges, not their jobs.
    assert any(done.punched() for done in saved.terminal.values())

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
    pinning = Envelope.from_bytes(next(iter(JournalReader(journal).records())).payload)
    assert pinning.run_at is not None
    time.sleep(max(0.0, pinning.run_at - time.time()))  # the pinning job is due: the drain runs it
    redelivered = restart_and_drain(journal, finished_before, compacted_before, JOBS)
    figures(
        f"saved index crash={point}:{nth} chains_resumed={resumed} "
        f"finished_before={finished_before.terminal_count} redelivered={redelivered} lost=0"
    )
