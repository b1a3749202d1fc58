"""D1 under load: 30,000 jobs complete, and the journal directory returns to a few segments.

A producer keeps writing (small segments, so it rotates often), the forwarder forwards and
harvests, the in-memory transport's worker runs everything; disk use is sampled throughout.
The figure line reports the peak and the end state. The default run has 30,000 jobs (about 24
segments of 256 KB written and deleted); the slow tier the 100,000 of scripts/bench-memory's D1
(``scripts/test -m slow tests/integration/test_compaction_load.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.journal import JournalWriter
from hybridq.journal.reader import list_chains, segment_usage
from hybridq.ledger.store import ledger_dir
from hybridq.ops.status import collect_status
from hybridq.transport import MemoryTransport

from tests.support.tiers import skip_unless_asked

CHUNK = 2_000
SEGMENT_BYTES = 256 << 10


@pytest.mark.parametrize("jobs", [30_000, pytest.param(100_000, marks=pytest.mark.slow)])
def test_d1_after_many_jobs_the_journal_is_back_to_a_few_segments(
    journal_dir: Path, figures: Callable[[str], None], request: pytest.FixtureRequest, jobs: int
) -> None:
    skip_unless_asked(request, "pytest -m slow tests/integration/test_compaction_load.py")
    queue = Queue(journal=journal_dir)
    transport = MemoryTransport()
    forwarder = Forwarder(journal_dir, transport, reconcile_interval_s=3600.0)
    forwarder.open()
    completions = forwarder.completions
    assert completions is not None
    peak_segments = peak_bytes = 0
    with JournalWriter(journal_dir, max_segment_bytes=SEGMENT_BYTES) as writer:
        for start in range(0, jobs, CHUNK):
            for batch in range(start, start + CHUNK, 100):
                writer.append_many(
                    queue.prepare("tests.tasks.add", (i, i)).to_bytes() for i in range(batch, batch + 100)
                )
            forwarder.step()
            transport.work()
            completions.hurry(reconcile=False)
            forwarder.step()
            segments, size = segment_usage(str(journal_dir))
            peak_segments, peak_bytes = max(peak_segments, segments), max(peak_bytes, size)
        live_segments, live_bytes = segment_usage(str(journal_dir))
    # The producer exits (its last segment is sealed): the forwarder reads the seal, then the
    # next round deletes that segment too.
    for _ in range(2):
        completions.hurry(reconcile=False)
        forwarder.step()
    forwarder.close()
    end_segments, _ = segment_usage(str(journal_dir))
    ledger_segments, ledger_bytes = segment_usage(ledger_dir(str(journal_dir)))
    out = collect_status(str(journal_dir))
    assert (out["accepted"], out["succeeded"], out["pending"]) == (jobs, jobs, 0)
    written = jobs * 200  # about 200 B per job: what the journal would hold without compaction
    assert live_segments <= 3, list_chains(str(journal_dir))
    assert end_segments == 0
    assert peak_bytes < written / 10  # bounded by the work in flight, not by the jobs ever written
    assert ledger_bytes < 8 << 20
    figures(
        f"D1 compaction jobs={jobs} peak_segments={peak_segments} peak_bytes={peak_bytes} "
        f"segments_while_producing={live_segments} bytes_while_producing={live_bytes} "
        f"segments_after={end_segments} ledger_segments={ledger_segments} ledger_bytes={ledger_bytes}"
    )
    assert os.path.isdir(journal_dir)
