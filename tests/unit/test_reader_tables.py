"""A reader's tables (no forwarder's file): a private temporary database, not one in memory.

Readers that replay the ledger (``hybridq failed list``, ``status``, ``doctor``, the dashboard's
long-lived view) keep the listed failures and the key owners in SQLite tables of their own. In
``:memory:`` those cost about 0.4 KB of RSS per failure (38 MB at 100,000); a temporary
database keeps SQLite's cache (2 MB) and spills the rest to a file of the temporary directory
(docs/reliability.md, the key table).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from hybridq.envelope.model import Envelope
from hybridq.ledger.entries import Entry
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.store import open_ledger_writer


def test_a_readers_table_is_a_temporary_database_not_one_in_memory() -> None:
    table = KeyTable()
    try:
        # ":memory:" answers "memory"; a temporary database (""), which can spill, "delete".
        assert table.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    finally:
        table.close()


_READER = textwrap.dedent(
    """
    import sys
    from hybridq.ledger.compacted import Compacted
    from hybridq.ledger.store import load_index

    def peak_kb():  # VmHWM: this process's own peak (ru_maxrss keeps the forking parent's)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))

    before = peak_kb()
    index = load_index(sys.argv[1], Compacted(), keys=False)
    print(len(index.failed), (peak_kb() - before) // 1024)
    """
)


def test_a_reader_listing_many_failures_does_not_hold_them_in_memory(tmp_path: Path) -> None:
    journal = str(tmp_path / "journal")
    ledger = open_ledger_writer(journal)
    for lo in range(0, 40_000, 1000):
        ledger.append_many(_failure(i).to_bytes() for i in range(lo, lo + 1000))
    ledger.close()
    # 40,000 failures of ~0.5 KB: 24 MB of RSS in a table in memory (main before this test);
    # SQLite's cache and the index's own figures stay under 12 MB (measured 4).
    out = subprocess.run(
        [sys.executable, "-c", _READER, journal],
        capture_output=True,
        text=True,
        check=True,
        env={"TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)},
        timeout=120,
    )
    listed, grown_mb = map(int, out.stdout.split())
    assert listed == 40_000
    assert grown_mb < 12, f"peak RSS grew {grown_mb} MB while listing 40,000 failures"


def _failure(i: int) -> Entry:
    env = Envelope(
        id=f"job-{i}", func="m.f", queue="q", args=[i, "x" * 200], idempotency_key=None, created_at=1.0
    )
    return Entry(
        "done", env.id, ("w", 1 + i // 1000, 32 + 200 * (i % 1000)), outcome="failed",
        error="ValueError: boom " * 4, at=float(i), queue="q", attempt=3, job=env.to_dict(),
    )  # fmt: skip
