"""S13 for compaction and harvest: a forwarder killed at each step loses nothing, counts stay exact.

A child process forwards jobs written in tiny segments through the in-memory transport, runs
them with its simulated worker, harvests and compacts, and SIGKILLs itself at one named crash
point (``HYBRIDQ_CRASH_POINT``). The parent then opens the journal with a fresh forwarder and a
fresh, empty transport (as if Redis had lost everything too) and checks: the journal verifies,
no job the ledger recorded as finished is delivered again, and the status counts are exact.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq.crashpoints import COMPACTION_NAMES, FORWARDER_NAMES
from hybridq.forwarder.loop import Forwarder
from hybridq.journal.recovery import verify
from hybridq.ledger.compacted import Compacted, load_compacted
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.store import load_index
from hybridq.ops.status import collect_status
from hybridq.transport import MemoryTransport

JOBS = 300

#: A child's start: ``{jobs}`` jobs in segments of ``{segment}`` bytes, a forwarder opened on
#: the in-memory transport and stepped once (``{setup}``: lines run before, such as settings).
CHILD_START = """
import sys
from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalWriter
from hybridq.transport import MemoryTransport
{setup}
journal = sys.argv[1]
queue = Queue(journal=journal)
with JournalWriter(journal, max_segment_bytes={segment}) as writer:
    for start in range(0, {jobs}, 10):
        writer.append_many(queue.prepare("tests.tasks.add", (i, i)).to_bytes() for i in range(start, start + 10))
transport = MemoryTransport()
forwarder = Forwarder(journal, transport, reconcile_interval_s=0.0, lease_s=0.0, max_lost=100)
forwarder.open()
forwarder.step()
"""

CHILD = (
    CHILD_START.format(jobs=JOBS, segment=4096, setup="")
    + f"""transport.work(limit={JOBS} // 2)
for _ in range(20):
    forwarder.completions.hurry()
    forwarder.step()
transport.work()
for _ in range(20):
    forwarder.completions.hurry()
    forwarder.step()
forwarder.close()
"""
)


@pytest.mark.parametrize("point", COMPACTION_NAMES + FORWARDER_NAMES[:1])
def test_s13_a_crash_at_each_step_of_compaction_or_harvest_loses_nothing(
    tmp_path: Path, point: str, figures: Callable[[str], None]
) -> None:
    journal = tmp_path / "journal"
    killed_at(f"{point}:2", CHILD, journal)
    finished_before = load_index(str(journal), load_compacted(str(journal)))
    compacted_before = load_compacted(str(journal))

    redelivered = restart_and_drain(journal, finished_before, compacted_before, JOBS)
    figures(
        f"S13 crash={point} accepted={JOBS} lost=0 redelivered={redelivered} "
        f"compacted_before={compacted_before.accepted} dup_execution=0"
    )


def restart_and_drain(
    journal: Path, finished_before: LedgerIndex, compacted_before: Compacted, jobs: int
) -> int:
    """Start a fresh forwarder on an empty transport, run everything; returns how many it pushed again.

    Checks that nothing recorded as finished (or compacted away) before the crash was delivered
    again, and that every job finished once, by the status counts.
    """
    transport = MemoryTransport()  # Redis lost everything as well
    forwarder = Forwarder(journal, transport, reconcile_interval_s=0.0, lease_s=0.0)
    forwarder.open()
    for _ in range(10):
        forwarder.step()
    redelivered = set(transport.jobs)
    transport.work()
    for _ in range(10):
        assert forwarder.completions is not None
        forwarder.completions.hurry()
        forwarder.step()
    forwarder.close()

    verify(journal)
    for job_id in redelivered:
        loc = transport.deliveries[job_id].loc
        assert not finished_before.is_terminal(loc), job_id
        assert not compacted_before.is_compacted((loc[0], loc[1])), job_id
    out = collect_status(str(journal))
    assert (out["accepted"], out["succeeded"], out["failed"], out["pending"]) == (jobs, jobs, 0, 0)
    return len(redelivered)


def killed_at(point: str, child: str, journal: Path) -> None:
    """Run ``child`` (Python) on ``journal`` with crash point ``point`` armed; it must be SIGKILLed."""
    env = {**os.environ, "HYBRIDQ_CRASH_POINT": point, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, "-c", child, str(journal)], env=env, capture_output=True, timeout=120, check=False
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
