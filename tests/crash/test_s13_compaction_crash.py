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
from hybridq.ledger.compacted import load_compacted
from hybridq.ledger.store import load_index
from hybridq.ops.status import collect_status
from hybridq.transport import MemoryTransport

JOBS = 300

CHILD = """
import sys
from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalWriter
from hybridq.transport import MemoryTransport
journal = sys.argv[1]
queue = Queue(journal=journal)
with JournalWriter(journal, max_segment_bytes=4096) as writer:
    for start in range(0, {jobs}, 10):
        writer.append_many(queue.prepare("tests.tasks.add", (i, i)).to_bytes() for i in range(start, start + 10))
transport = MemoryTransport()
forwarder = Forwarder(journal, transport, reconcile_interval_s=0.0, lease_s=0.0, max_lost=100)
forwarder.open()
forwarder.step()
transport.work(limit={jobs} // 2)
for _ in range(20):
    forwarder.completions.hurry()
    forwarder.step()
transport.work()
for _ in range(20):
    forwarder.completions.hurry()
    forwarder.step()
forwarder.close()
"""


@pytest.mark.parametrize("point", COMPACTION_NAMES + FORWARDER_NAMES[:1])
def test_s13_a_crash_at_each_step_of_compaction_or_harvest_loses_nothing(
    tmp_path: Path, point: str, figures: Callable[[str], None]
) -> None:
    journal = tmp_path / "journal"
    env = {**os.environ, "HYBRIDQ_CRASH_POINT": f"{point}:2", "PYTHONPATH": os.getcwd()}
    child = subprocess.run(
        [sys.executable, "-c", CHILD.format(jobs=JOBS), str(journal)],
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    finished_before = load_index(str(journal), load_compacted(str(journal)))
    compacted_before = load_compacted(str(journal))

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
    # Nothing recorded as finished (or compacted away) before the crash was delivered again.
    for job_id in redelivered:
        loc = transport.deliveries[job_id].loc
        assert not finished_before.is_terminal(loc), job_id
        assert not compacted_before.is_compacted((loc[0], loc[1])), job_id
    out = collect_status(str(journal))
    assert (out["accepted"], out["succeeded"], out["failed"], out["pending"]) == (JOBS, JOBS, 0, 0)
    figures(
        f"S13 crash={point} accepted={JOBS} lost=0 redelivered={len(redelivered)} "
        f"compacted_before={compacted_before.accepted} dup_execution=0"
    )
