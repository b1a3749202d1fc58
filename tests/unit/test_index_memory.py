"""What the ledger's in-memory index costs per finished job, measured with tracemalloc (not timed).

Issue 29's memory bound: until its journal segment is compacted, a finished job is one entry of
:attr:`LedgerIndex.terminal` (its offset, and its outcome as one shared string). The outcome used
to be the entry's own string, decoded from its JSON: 58 more bytes per job.
"""

from __future__ import annotations

import gc
import tracemalloc

from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex

JOBS = 5_000
#: Bytes per finished job the index may grow by (57 measured on CPython 3.11: a dict slot and
#: the offset's int; 115 before the outcome strings were shared).
BOUND = 80


def test_finishing_jobs_grows_the_index_by_less_than_the_bound_per_job() -> None:
    raw = [
        Entry("done", f"job-{i}", ("chain", 3, 4096 + 300 * i), outcome="succeeded", at=1.0).to_bytes()
        for i in range(JOBS)
    ]
    index = LedgerIndex()
    index.apply(Entry.from_bytes(raw[0]))  # the segment's map exists before the count starts
    gc.collect()
    tracemalloc.start()
    try:
        for payload in raw[1:]:
            index.apply(Entry.from_bytes(payload))  # as the harvest and a restart's replay do
        gc.collect()
        grown, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index.terminal_count == JOBS
    assert grown / JOBS < BOUND, f"{grown / JOBS:.0f} bytes per finished job"
