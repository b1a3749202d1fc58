"""The disk a journal holds, beside its files' sizes (``journal.disk_bytes``, ``hybridq_journal_disk_bytes``).

Finished records punched out of pinned segments free their blocks and keep the files' sizes
(docs/journal.md, "Finished records punched out of pinned segments"): ``journal.bytes`` stays
the sizes (a contract), the new figure is the blocks the segments hold.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from hybridq import Queue
from hybridq.forwarder.loop import Forwarder
from hybridq.http.config import ServeConfig
from hybridq.journal import JournalReader, JournalWriter
from hybridq.journal.format import parse_segment_name
from hybridq.journal.holes import Hole, add_holes
from hybridq.ops.metrics import ForwarderMetrics
from hybridq.ops.status import stats
from hybridq.transport import MemoryTransport

from tests import tasks
from tests.support.http import request, served


def _on_disk(journal: Path) -> int:
    """What ``du`` counts of the segments: their blocks."""
    names = [n for n in os.listdir(journal) if parse_segment_name(n) is not None]
    return sum(os.stat(journal / n).st_blocks * 512 for n in names)


def _journal_figures(journal: Path) -> dict[str, int]:
    """``status --json``'s ``journal`` object (what ``hybridq.stats()`` answers)."""
    got = stats(journal, redis_url=None, outbox=None, redis_for=None)["journal"]
    assert isinstance(got, dict)
    return got


def test_status_reports_the_blocks_the_segments_hold_beside_their_sizes(journal_dir: Path) -> None:
    with JournalWriter(journal_dir, max_segment_bytes=16384) as writer:
        writer.append(b"x" * 100)
    fresh = _journal_figures(journal_dir)
    assert fresh["disk_bytes"] == _on_disk(journal_dir) > 0


def test_a_punched_segment_counts_its_size_in_bytes_and_only_its_blocks_in_disk_bytes(
    journal_dir: Path,
) -> None:
    with JournalWriter(journal_dir, max_segment_bytes=16384) as writer:
        for start in range(0, 400, 10):
            writer.append_many([b"%06d" % i + b"x" * 200 for i in range(start, start + 10)])
    before = _journal_figures(journal_dir)
    seg0 = [r for r in JournalReader(journal_dir).records() if r.segment_index == 0]
    a, b = seg0[1], seg0[-2]
    add_holes(str(journal_dir), a.writer_id, 0, [Hole(a.offset, b.end, a.seq, b.seq + 1, len(seg0) - 2)])
    after = _journal_figures(journal_dir)
    assert after["bytes"] == before["bytes"]  # the sizes, as before (a contract)
    assert after["segments"] == before["segments"]
    assert after["disk_bytes"] == _on_disk(journal_dir)
    assert after["disk_bytes"] <= before["disk_bytes"] - 8192  # most of a 16 KiB segment freed
    assert after["disk_bytes"] < after["bytes"]


def test_the_forwarders_metrics_export_the_disk_bytes(journal_dir: Path) -> None:
    Queue(journal=journal_dir).enqueue(tasks.add, 1, 1)
    with Forwarder(journal_dir, MemoryTransport()) as forwarder:
        forwarder.step()
        values = {m.name: m.samples[0].value for m in ForwarderMetrics(forwarder).collect()}
    assert values["hybridq_journal_disk_bytes"] == _on_disk(journal_dir) > 0
    assert values["hybridq_journal_bytes"] > 0


def test_the_servers_stats_and_metrics_carry_the_disk_bytes(journal_dir: Path) -> None:
    config = ServeConfig(journal=journal_dir, port=0, allow=("tests",))  # type: ignore[arg-type]
    with served(config) as base:
        request(base, "POST", "/v1/jobs", {"task": "tests.tasks.add", "args": [1, 2]})
        got = request(base, "GET", "/v1/stats").json
        text = request(base, "GET", "/metrics").raw.decode()
    assert got["journal"]["disk_bytes"] == _on_disk(journal_dir) > 0
    scraped = re.search(r"^hybridq_journal_disk_bytes ([0-9.e+]+)$", text, re.MULTILINE)
    assert scraped is not None, text
    assert float(scraped.group(1)) == _on_disk(journal_dir)
