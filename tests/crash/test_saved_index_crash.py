"""The saved ledger index under SIGKILL: a start never trusts more than the ledger holds.

A child forwards jobs through the in-memory transport, runs them, harvests and compacts, saving
its ledger index every few entries (``SAVE_EVERY`` lowered), and SIGKILLs itself while the index
file is half written (``index_mid_write``), right after it was replaced (``index_after_save``),
or between a ledger append and the next save (``harvest_after_ledger``). The parent then starts a
fresh forwarder on the journal: its index must be the full replay's (``load_index``), no job the
ledger recorded as finished is delivered again, every job runs, and the status counts are exact.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq.forwarder.loop import Forwarder
from hybridq.journal.recovery import verify
from hybridq.ledger import saved_index
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
from hybridq.ledger import saved_index
from hybridq.transport import MemoryTransport
saved_index.SAVE_EVERY = 7
journal = sys.argv[1]
queue = Queue(journal=journal)
with JournalWriter(journal, max_segment_bytes=16384) as writer:
    for start in range(0, {jobs}, 10):
        writer.append_many(queue.prepare("tests.tasks.add", (i, i)).to_bytes() for i in range(start, start + 10))
transport = MemoryTransport()
forwarder = Forwarder(journal, transport, reconcile_interval_s=0.0, lease_s=0.0, max_lost=100)
forwarder.open()
forwarder.step()
for _ in range(30):
    transport.work(limit=10)
    forwarder.completions.hurry()
    forwarder.step()
forwarder.close()
"""


@pytest.mark.parametrize(
    ("point", "nth"),
    [("index_mid_write", 60), ("index_after_save", 8), ("harvest_after_ledger", 12)],
)
def test_a_crash_while_the_index_is_saved_or_after_trusts_only_the_ledger(
    tmp_path: Path, point: str, nth: int, figures: Callable[[str], None]
) -> None:
    journal = tmp_path / "journal"
    env = {**os.environ, "HYBRIDQ_CRASH_POINT": f"{point}:{nth}", "PYTHONPATH": os.getcwd()}
    child = subprocess.run(
        [sys.executable, "-c", CHILD.format(jobs=JOBS), str(journal)],
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    compacted_before = load_compacted(str(journal))
    finished_before = load_index(str(journal), compacted_before)
    _, _, resumed = saved_index.resume(str(journal), compacted_before)
    assert resumed > 0  # the index saved before the crash is whole, and used

    transport = MemoryTransport()  # Redis lost everything as well
    forwarder = Forwarder(journal, transport, reconcile_interval_s=0.0, lease_s=0.0)
    forwarder.open()
    assert forwarder.state.index == finished_before  # resumed from the saved index, or replayed
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
    assert (out["accepted"], out["succeeded"], out["failed"], out["pending"]) == (JOBS, JOBS, 0, 0)
    figures(
        f"saved index crash={point}:{nth} chains_resumed={resumed} "
        f"finished_before={finished_before.terminal_count} redelivered={len(redelivered)} lost=0"
    )
