"""Helpers that write journals for tests, and leave them in the states crashes leave them in."""

from __future__ import annotations

import os
from pathlib import Path

from hybridq.journal import JournalReader, JournalWriter, Record


def abandon_writer(writer: JournalWriter) -> None:
    """Drop a writer the way SIGKILL would: its segment stays unsealed and its flock is released."""
    seg = writer._segment
    if seg is not None:
        os.close(seg.fd)
    writer._segment = None
    writer._closed = True


def small_segments(directory: Path, records: int = 300) -> list[Record]:
    """A new journal directory of one chain of 8 KiB segments, closed (all sealed); its records.

    ``records`` records of 106 bytes (a ``%06d`` number, then ``y``), appended ten at a time.
    """
    directory.mkdir(parents=True, mode=0o700)
    with JournalWriter(directory, max_segment_bytes=8 << 10) as writer:
        for start in range(0, records, 10):
            writer.append_many([b"%06d" % i + b"y" * 100 for i in range(start, start + 10)])
    return list(JournalReader(directory).records())
