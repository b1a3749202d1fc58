"""Helpers that write journals for tests, and leave them in the states crashes leave them in."""

from __future__ import annotations

import os
from pathlib import Path

from hybridq.journal import JournalReader, JournalWriter, Record
from hybridq.journal.format import segment_name
from hybridq.journal.reader import list_chains
from hybridq.ledger import saved_index
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.entries import Entry
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.store import ledger_dir, open_ledger_writer, replay


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


def closed_ledger(directory: Path) -> tuple[str, Path]:
    """A journal whose ledger chain was closed (its last segment sealed) and its index saved.

    The journal: one chain of three 4 KiB segments. Its ledger: 120 successes of its jobs, in
    2 KiB segments. Returns the journal's path and the ledger's last segment.
    """
    journal = directory / "journal"
    with JournalWriter(journal, max_segment_bytes=4096) as writer:
        for _ in range(3):
            writer.append_many([b'{"x": "' + b"y" * 3000 + b'"}'])
    ((writer_id, _),) = list_chains(str(journal)).items()
    chain = open_ledger_writer(str(journal))
    chain.max_segment_bytes = 2048
    chain.append_many(
        Entry(
            "done", f"job{i}", (writer_id, i % 3, 32 + 100 * i), outcome="succeeded", at=float(i)
        ).to_bytes()
        for i in range(120)
    )
    chain.close()
    index = LedgerIndex(keys=KeyTable.in_journal(str(journal)))
    saved_index.save(str(journal), index, replay(str(journal), index, Compacted()), {})
    ((ledger_writer, indices),) = list_chains(ledger_dir(str(journal))).items()
    return str(journal), Path(ledger_dir(str(journal))) / segment_name(ledger_writer, indices[-1])
