"""The CPU of punching the ledger, per entry looked at (issue 29, ``hybridq.forwarder.ledger_punch``).

Builds a journal of ``--jobs`` jobs in 1 MiB segments whose first job never finishes (it pins
every segment), a ledger (4 MiB segments) with a success of every other job and a ``retry``
before one in ten, punches the journal's finished records, then times (``time.process_time``:
CPU, not wall clock) the ledger puncher's passes over every sealed ledger segment: once as
shipped, once with ``done_in_ranges`` (the successes too). Prints the CPU per entry looked at,
the entries and bytes punched. Runs against whatever ``hybridq`` is importable (PYTHONPATH).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from hybridq.forwarder.dead_segments import Compactor
from hybridq.forwarder.punch import Puncher
from hybridq.journal import JournalReader, JournalWriter
from hybridq.ledger.entries import Entry
from hybridq.ledger.store import ledger_dir
from tests.unit.test_ledger_punch import _open


def _allocated(path: str) -> int:
    return sum(e.stat().st_blocks * 512 for e in os.scandir(path) if e.name.endswith(".wal"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=60_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-lpunch-") as tmp:
        journal = os.path.join(tmp, "a")
        with JournalWriter(journal, max_segment_bytes=1 << 20) as writer:
            for start in range(0, args.jobs, 100):
                writer.append_many(
                    b'{"job":%08d,"pad":"%s"}' % (i, b"x" * 200) for i in range(start, start + 100)
                )
        records = list(JournalReader(journal).records())
        wid = records[0].writer_id
        last = records[-1].segment_index
        through = {wid: last + 1}
        state = _open(journal, through)
        batch: list[Entry] = []
        for r in records[1:]:
            loc = (r.writer_id, r.segment_index, r.offset)
            if r.seq % 10 == 3:
                batch.append(Entry("retry", f"j{r.seq}", loc, attempt=1, run_at=1.0, at=1.0))
            batch.append(Entry("done", f"j{r.seq}", loc, outcome="succeeded", at=1.0))
            if len(batch) >= 1000:
                state.append(batch)
                batch = []
        state.append(batch)
        while Puncher(state).step():
            pass
        state.close()
        copy = os.path.join(tmp, "b")
        shutil.copytree(journal, copy)
        for path, done in ((journal, False), (copy, True)):
            state = _open(path, through)
            compactor = Compactor(state)
            puncher = compactor.ledger_puncher
            puncher.done_in_ranges = done
            before = _allocated(ledger_dir(path))
            started = time.process_time()
            for _ in range(50):
                puncher.step(1)
            cpu = time.process_time() - started
            after = _allocated(ledger_dir(path))
            state.close()
            print(
                f"done_in_ranges={done} entries_looked={puncher.looked} cpu={cpu:.3f}s "
                f"per_entry={1e6 * cpu / max(1, puncher.looked):.2f}us punched={puncher.punched} "
                f"ledger_on_disk {before} -> {after}"
            )


if __name__ == "__main__":
    main()
