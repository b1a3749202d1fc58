"""SIGKILL inside the ledger compaction that moves a finished job's key to the key store.

(a) after the key store append, before the ledger segment is deleted; (b) after the delete,
before the saved index is written. Then a second job with the key within the window is a
duplicate (never pushed), and after the window a third one is pushed (no stale owner that never
expires): docs/reliability.md, "The key table", rules 4 and 5. (Adopted from the review of
issue 29's branch: it passed there; the branch's other crash test never compacts the ledger.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.ledger.store import read_ledger
from hybridq.transport import MemoryTransport

from tests.unit.test_completions import Clock, make_forwarder, settle

CHILD = """
import os, signal, sys
from pathlib import Path
from hybridq import Queue
from hybridq.forwarder import dead_segments
from hybridq.producer.queue import _close_writers
from hybridq.transport import MemoryTransport
from tests.unit.test_completions import Clock, make_forwarder, settle
journal, where = Path(sys.argv[1]), sys.argv[2]
clock = Clock()
Queue(journal=journal).enqueue("tests.tasks.add", 1, 2, idempotency_key="K", job_id="first")
_close_writers()
t = MemoryTransport()
f = make_forwarder(journal, t, clock=clock, key_window_s=3600.0)
f.step(); t.work(); settle(f); f.close()
real = dead_segments.remove_oldest_segment
def remove(path, writer, index):
    if path.endswith("ledger") and where == "before_delete":
        os.kill(os.getpid(), signal.SIGKILL)
    real(path, writer, index)
    if path.endswith("ledger") and where == "after_delete":
        os.kill(os.getpid(), signal.SIGKILL)
dead_segments.remove_oldest_segment = remove
f = make_forwarder(journal, t, clock=clock, key_window_s=3600.0)  # compacts the ledger
settle(f)
f.close()
print("NOT KILLED")
"""


@pytest.mark.parametrize("where", ["before_delete", "after_delete"])
def test_a_kill_inside_ledger_compaction_keeps_the_owner_and_its_window(tmp_path: Path, where: str) -> None:
    journal = tmp_path / "journal"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(journal), where],
        check=False,
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGKILL, (done.stdout + done.stderr).decode()[-2000:]
    clock = Clock()
    clock.now += 10
    t = MemoryTransport()
    f = make_forwarder(journal, t, clock=clock, key_window_s=3600.0)
    try:
        Queue(journal=journal).enqueue("tests.tasks.add", 1, 2, idempotency_key="K", job_id="within")
        settle(f)
        settle(f)
        assert "within" not in t.deliveries, "a duplicate within the window was pushed"
        assert "within" in {e.job_id for _, e in read_ledger(str(journal)) if e.kind == "duplicate"}
    finally:
        f.close()
    # once more so the ledger segment is compacted if it survived, then past every window
    clock.now += 10
    f = make_forwarder(journal, t, clock=clock, key_window_s=3600.0)
    settle(f)
    f.close()
    clock.now += 2 * 3600.0 + 100
    f = make_forwarder(journal, t, clock=clock, key_window_s=3600.0)
    try:
        Queue(journal=journal).enqueue("tests.tasks.add", 1, 2, idempotency_key="K", job_id="after")
        settle(f)
        assert "after" in t.deliveries, "past the window, a job with the key was never pushed (stale owner)"
    finally:
        f.close()
