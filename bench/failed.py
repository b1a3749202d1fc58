"""Jobs that failed for good, listed for ``hybridq failed requeue``: what they cost (issue 29).

``--failures`` failed ``done`` entries (each with its envelope, ~20 B of arguments, an error of
68 B: about 310 B of JSON), then, each in a process of its own:

  * ``heap``: tracemalloc bytes per failure folded into the forwarder's ledger index (its
    on-disk table), the entry built in the traced window as harvest builds it; and CPU µs per
    failure of ``LedgerIndex.apply`` (the ledger append's JSON passed where the tree takes it);
  * ``rss``: a ``ForwarderState`` records them (1,000 per append, the end of a step after each:
    saves when due); its RSS (``/proc``) before and after, after a clean stop and a new start,
    and the saved index's size;
  * ``reader``: ``load_index(keys=False)`` over a ledger of them (``hybridq failed list``,
    status): CPU µs per failure and the peak RSS it added.

Runs against whatever ``hybridq`` is importable: run it by its path with PYTHONPATH set to each
tree, from a directory outside both (``cd /tmp && PYTHONPATH=TREE python TREE/bench/failed.py``).
CPU time, not wall clock.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from hybridq.envelope.model import Envelope
from hybridq.forwarder.state import ForwarderConfig, ForwarderState
from hybridq.journal import JournalWriter
from hybridq.journal.reader import list_chains
from hybridq.ledger import saved_index
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.store import load_index, open_ledger_writer


def failure(i: int, writer: str = "w") -> Entry:
    env = Envelope(
        id=f"job-{i}", func="mod.func", queue="q", args=[i, "x" * 20], idempotency_key=None, created_at=1.0
    )
    return Entry(
        "done", env.id, (writer, 1 + i // 1000, 32 + 200 * (i % 1000)), outcome="failed",
        error="ValueError: boom " * 4, at=float(i), queue="q", attempt=3, job=env.to_dict(),
    )  # fmt: skip


def _rss_mb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def heap(n: int) -> str:
    index = LedgerIndex(keys=KeyTable.in_journal(tempfile.mkdtemp()))
    raw = "raw" in inspect.signature(index.apply).parameters

    def fold(entry: Entry) -> None:
        index.apply(entry, entry.to_bytes()) if raw else index.apply(entry)  # type: ignore[call-arg]

    for i in range(1000):
        fold(failure(i))
    gc.collect()
    tracemalloc.start()
    for i in range(1000, n + 1000):
        fold(failure(i))
    index.keys.commit()
    gc.collect()
    grown, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    more = [failure(i) for i in range(n + 1000, 2 * n + 1000)]
    raws = [e.to_bytes() for e in more]  # the ledger append encodes each entry anyway
    started = time.process_time()
    for e, r in zip(more, raws, strict=True):
        index.apply(e, r) if raw else index.apply(e)  # type: ignore[call-arg]
    index.keys.commit()
    cpu = time.process_time() - started
    return f"heap bytes/failure={grown / n:.0f} apply CPU µs/failure={cpu / n * 1e6:.1f}"


def _journal() -> tuple[str, str]:
    journal = Path(tempfile.mkdtemp()) / "journal"
    with JournalWriter(journal) as jw:
        jw.append_many([b"{}"])
    [(writer, _)] = list_chains(str(journal)).items()
    return str(journal), writer


def rss(n: int) -> str:
    journal, writer = _journal()
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    start = _rss_mb()
    for lo in range(0, n, 1000):
        state.append([failure(i, writer) for i in range(lo, lo + 1000)])
        state.refresh_snapshot()
    gc.collect()
    recorded = _rss_mb()
    state.close()
    size = os.path.getsize(os.path.join(journal, saved_index.SAVED_INDEX_NAME + ".state"))
    state = ForwarderState(journal, ForwarderConfig())
    state.load()
    gc.collect()
    listed = len(state.index.failed)
    state.close()
    return (
        f"RSS MB start={start} recorded={recorded} after a restart={_rss_mb()} listed={listed}"
        f" saved index KB={size // 1024}"
    )


def reader(n: int) -> str:
    journal = tempfile.mkdtemp()
    ledger = open_ledger_writer(journal)
    for lo in range(0, n, 1000):
        ledger.append_many(failure(i).to_bytes() for i in range(lo, lo + 1000))
    ledger.close()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.process_time()
    index = load_index(journal, Compacted(), keys=False)
    cpu = time.process_time() - started
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
    return f"reader CPU µs/failure={cpu / n * 1e6:.1f} peak RSS added MB={grown} listed={len(index.failed)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failures", type=int, default=100_000)
    parser.add_argument("--only", choices=["heap", "rss", "reader"])
    args = parser.parse_args()
    if args.only:
        print({"heap": heap, "rss": rss, "reader": reader}[args.only](args.failures), flush=True)
        return
    for part in ("heap", "rss", "reader"):
        cmd = [sys.executable, __file__, "--failures", str(args.failures), "--only", part]
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
