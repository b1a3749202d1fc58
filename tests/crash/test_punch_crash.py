"""A forwarder killed at each step of punching finished records loses nothing and runs nothing twice.

A child writes jobs in tiny segments, the first one delayed (it pins its segment), forwards and
runs the others, so its compactor punches their records (hybridq.forwarder.punch), and SIGKILLs
itself at one punching crash point. The parent restarts on a fresh, empty transport (Redis lost
everything too) and drains: the journal verifies, no job finished before the crash is delivered
again, every job finishes once (the status counts), the pinning job's record still reads, and
the punched segment is deleted once it finishes.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hybridq.crashpoints import PUNCH_NAMES
from hybridq.envelope.model import Envelope
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalReader
from hybridq.journal.format import segment_name
from hybridq.journal.holes import HOLES_SUFFIX, read_holes
from hybridq.journal.reader import list_chains
from hybridq.journal.recovery import verify
from hybridq.ledger.compacted import load_compacted
from hybridq.ledger.store import load_index
from hybridq.ops.status import collect_status
from hybridq.ops.status_counts import scan_counts as status_counts
from hybridq.transport import MemoryTransport

from tests.crash.test_s13_compaction_crash import killed_at

JOBS = 1200
#: Two stats-tracker blocks (512 records or 1 MiB each) per segment: the pinning job's block
#: stays (the tracker may read it back), the other one is punched.
SEGMENT = 2 << 20
PAD = "x" * 900
DELAY_S = 3.0

CHILD = f"""
import sys
from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalWriter
from hybridq.transport import MemoryTransport
journal = sys.argv[1]
queue = Queue(journal=journal)
with JournalWriter(journal, max_segment_bytes={SEGMENT}) as writer:
    writer.append_many([queue.prepare("tests.tasks.add", ("a", "b"), delay={DELAY_S}).to_bytes()])
    for start in range(1, {JOBS}, 10):
        writer.append_many(
            queue.prepare("tests.tasks.add", ("{PAD}", "%d" % i)).to_bytes() for i in range(start, min(start + 10, {JOBS}))
        )
transport = MemoryTransport()
forwarder = Forwarder(journal, transport, reconcile_interval_s=0.0, lease_s=0.0, max_lost=100)
forwarder.open()
for _ in range(30):
    forwarder.step()
    transport.work()
    forwarder.completions.hurry()
    forwarder.completions.compactor.hurry()
    forwarder.step()
forwarder.close()
"""

# Without a crash point the child must punch: checked by the test below (so the points are reached).
CHILD_PLAIN = CHILD.replace("forwarder.close()", "forwarder.close()\nraise SystemExit(0)")


def _holes(journal: Path) -> list[str]:
    return [n for n in os.listdir(journal) if HOLES_SUFFIX in n]


def _drain(journal: Path, jobs: int = JOBS, *, ahead_s: float = 0.0) -> list[tuple[str, int, int]]:
    """Restart on an empty transport and run everything; returns where each job delivered was.

    ``ahead_s``: the forwarder's clock that far ahead, so a job delayed that long is due at once.
    """
    transport = MemoryTransport()
    forwarder = Forwarder(
        journal, transport, reconcile_interval_s=0.0, lease_s=0.0, clock=lambda: time.time() + ahead_s
    )
    forwarder.open()
    delivered: dict[str, tuple[str, int, int]] = {}
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            forwarder.step()
            delivered.update((job_id, transport.deliveries[job_id].loc) for job_id in transport.jobs)
            transport.work()
            assert forwarder.completions is not None
            forwarder.completions.hurry()
            forwarder.completions.compactor.hurry()
            forwarder.step()
            out = collect_status(str(journal))
            if out["succeeded"] == jobs and not list_chains(str(journal)):
                break
            time.sleep(0.1)
    finally:
        forwarder.close()
    return list(delivered.values())


@pytest.mark.parametrize("point", [p for p in PUNCH_NAMES if p != "punch_writable" or os.geteuid() != 0])
def test_a_crash_at_each_step_of_punching_loses_nothing(tmp_path: Path, point: str) -> None:
    journal = tmp_path / "journal"
    killed_at(f"{point}:1", CHILD, journal)
    assert _holes(journal)  # killed after the map was written (or while the segment was writable)
    compacted = load_compacted(str(journal))
    finished = load_index(str(journal), compacted)
    verify(journal)  # a map written, the punch done or not: no damage either way
    first = next(iter(JournalReader(journal).records()))  # the pinning job: still there
    assert tuple(Envelope.from_bytes(first.payload).args) == ("a", "b")
    again = _drain(journal)
    for loc in again:  # nothing finished before the crash was delivered again
        assert not finished.is_terminal(loc), loc
        assert not compacted.is_compacted((loc[0], loc[1])), loc
    verify(journal)
    out = collect_status(str(journal))
    assert (out["accepted"], out["succeeded"], out["failed"], out["pending"]) == (JOBS, JOBS, 0, 0)
    assert _holes(journal) == []


def test_without_a_crash_the_segment_is_punched_then_deleted(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", CHILD_PLAIN, str(journal)],
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    ((writer, indices),) = list_chains(str(journal)).items()
    assert _holes(journal) == [segment_name(writer, indices[0]) + HOLES_SUFFIX + ".state"]
    st = os.stat(journal / segment_name(writer, indices[0]))
    assert st.st_blocks * 512 < st.st_size * 0.75  # about half the segment's blocks freed
    first = next(iter(JournalReader(journal).records()))  # the pinning job reads; the others are gone
    assert tuple(Envelope.from_bytes(first.payload).args) == ("a", "b")
    assert sum(1 for r in JournalReader(journal).records() if r.segment_index == indices[0]) < JOBS // 2
    # The status counts by a scan of the journal count the punched records as accepted, finished.
    counts = status_counts(str(journal), load_compacted(str(journal)))
    assert (counts["accepted"], counts["succeeded"], counts["pending"]) == (JOBS, JOBS - 1, 1)
    _drain(journal)
    assert _holes(journal) == []
    assert list_chains(str(journal)) == {}


# The pushed list's mark is flushed once a second: a punch can cover it (a run read, pushed and
# finished within that second). The mark is taken inside segment 0, its flush then held back.
CHILD_MARK = f"""
import sys
from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.forwarder import pushed
from hybridq.journal import JournalWriter
from hybridq.transport import MemoryTransport
journal = sys.argv[1]
queue = Queue(journal=journal)
writer = JournalWriter(journal, max_segment_bytes={SEGMENT})
writer.append_many([queue.prepare("tests.tasks.add", ("a", "b"), delay=8.0).to_bytes()])
def batch(first, n):
    for start in range(first, first + n, 10):
        writer.append_many(
            queue.prepare("tests.tasks.add", ("{PAD}", "%d" % i)).to_bytes() for i in range(start, start + 10)
        )
batch(1, 500)
transport = MemoryTransport()
forwarder = Forwarder(journal, transport, reconcile_interval_s=3600.0, lease_s=0.0)
forwarder.open()
for _ in range(5):
    forwarder.step()
    transport.work()
    forwarder.step()
forwarder.state.flush_pushed(force=True)
pushed.PushedJobs.due = lambda self, positions: False
batch(501, 1500)
writer.close()
for _ in range(30):
    forwarder.step()
    transport.work()
    forwarder.completions.compactor.hurry()
    forwarder.step()
"""


def test_a_restart_whose_pushed_mark_lies_inside_a_punched_run_works(tmp_path: Path) -> None:
    """The mark, saved before the punch, points into the run: the catch-up reads on after it."""
    journal = tmp_path / "journal"
    killed_at("punch_after_punch:1", CHILD_MARK, journal)
    ((writer, indices),) = list_chains(str(journal)).items()
    runs = read_holes(str(journal), writer, indices[0])
    with sqlite3.connect(journal / "runs" / "runs.sqlite") as db:
        ((raw,),) = db.execute("select value from meta where name='pushed_mark'").fetchall()
    mark = json.loads(raw)[writer]
    assert mark[0] == indices[0]
    assert any(h.start < mark[1] < h.end for h in runs), (mark, runs)  # the case under test
    finished = load_index(str(journal), load_compacted(str(journal)))
    again = _drain(journal, 2001)
    for loc in again:
        assert not finished.is_terminal(loc), loc
    verify(journal)
    out = collect_status(str(journal))
    assert (out["accepted"], out["succeeded"], out["failed"], out["pending"]) == (2001, 2001, 0, 0)
