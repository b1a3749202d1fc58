"""What compaction needs of one sealed ledger segment, decoding only the entries it may keep.

Compaction (``hybridq.forwarder.dead_segments``) deletes a ledger segment once every entry in it
names a deleted journal segment. To decide, it needs every entry's ``loc``; to delete, it keeps
only these entries: failures (``done`` with the outcome ``failed``: appended again while
still listed), marks (requeues, and successes that outranked a failure, ``"over":"failed"``:
appended again while a failure they cancel lives elsewhere) and ``key`` entries (moved to the
key store). A 4 MiB segment holds about 28,000 entries, nearly all
successes: building an :class:`Entry` of each cost ten times reading the records (issue 29).

:func:`scan_ledger_segment` reads the kind and the ``loc`` of an entry from the front of its
compact JSON (:meth:`Entry.to_bytes` writes ``t``, ``id`` and ``loc`` first) and decodes whole
only the entries of the kinds above; any record whose front does not have that exact shape, or
a success whose payload holds ``"o":"failed"`` outside a string (a task's result
``{"o": "failed"}``), is decoded whole as well: a look-alike costs time, never a wrong answer.

This module must not import redis or rq.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hybridq.journal import JournalReader, RecordType
from hybridq.ledger.entries import Entry, Seg
from hybridq.ledger.punched_ids import named_segments
from hybridq.ledger.store import ledger_dir

__all__ = ["LedgerSegmentScan", "all_gone", "scan_ledger_segment"]

# The front of an entry as Entry.to_bytes writes it: the kind, the job id (a JSON string: any
# character but a quote or backslash, or an escape), then the loc's writer and segment. A quote
# inside a JSON string is always escaped, so the id cannot end early or hide a fake "loc".
_FRONT = re.compile(rb'\{"t":"([a-z]+)","id":"[^"\\]*(?:\\.[^"\\]*)*","loc":\["([0-9A-Za-z_.\-]*)",([0-9]+),')
#: Kinds never kept: only their ``loc`` matters. ``done`` is kept only as a failure.
_LOC_ONLY = frozenset({b"retry", b"lost", b"duplicate", b"cancel"})
#: How a failure's outcome is written (an ASCII word: compact JSON never escapes it), and the
#: mark of a success that outranked one.
_FAILED = b'"o":"failed"'
_OVER = b'"over":"failed"'


@dataclass(frozen=True, slots=True)
class LedgerSegmentScan:
    """One sealed ledger segment, as compaction sees it."""

    #: Per journal writer id, the highest journal segment index an entry of this segment names.
    reach: dict[str, int]
    #: In order, every failure (``done``, outcome ``failed``), mark (requeued, or a success
    #: ``over`` a failure) and ``key`` entry.
    kept: list[Entry]
    #: Entries decoded whole (for tests and profiles).
    decoded: int

    def all_gone(self, gone: Callable[[Seg], bool]) -> bool:
        """Whether every entry names a journal segment ``gone`` says was deleted (:func:`all_gone`)."""
        return all_gone(self.reach, gone)


def all_gone(reach: Mapping[str, int], gone: Callable[[Seg], bool]) -> bool:
    """Whether every entry of a segment names a journal segment ``gone`` says was deleted.

    ``reach`` is the segment's :attr:`LedgerSegmentScan.reach`. ``gone`` must hold for every
    lower index of a writer when it holds for one (compaction deletes each chain oldest first),
    so the highest index named per writer decides.
    """
    return all(gone(seg) for seg in reach.items())


def scan_ledger_segment(journal: str, writer_id: str, index: int) -> LedgerSegmentScan:
    """Scan sealed segment ``index`` of the ledger chain ``writer_id`` of ``journal``.

    Same result as decoding every entry (``ledger.store.read_ledger_segment``) for the questions
    compaction asks, except that a garbled record whose front is well formed counts its ``loc``
    (the full decode skips it): that can only keep the segment longer. Raises
    :class:`JournalCorruption` on damage (an unsealed segment too).
    """
    reach: dict[str, int] = {}
    kept: list[Entry] = []
    decoded = 0
    match = _FRONT.match
    # The (writer, segment) pairs skipped entries name, as bytes: a few distinct ones per
    # segment, converted once at the end rather than per entry.
    named: set[tuple[bytes, bytes]] = set()
    for record in JournalReader(ledger_dir(journal)).segment_records(writer_id, index):
        if record.rtype != RecordType.DATA:
            continue
        payload = record.payload
        front = match(payload)
        if front is not None:
            kind = front.group(1)
            if kind in _LOC_ONLY or (kind == b"done" and _FAILED not in payload and _OVER not in payload):
                named.add((front[2], front[3]))
                continue
        decoded += 1
        try:
            entry = Entry.from_bytes(payload)
        except (ValueError, KeyError, TypeError):
            continue  # passed its checksum, so a bug: the full decode skips it too
        writer, segment = entry.loc[0], entry.loc[1]
        if reach.get(writer, -1) < segment:
            reach[writer] = segment
        if entry.kind in ("requeued", "key") or (
            entry.kind == "done" and (entry.outcome == "failed" or entry.over is not None)
        ):
            kept.append(entry)
    for raw_writer, raw_segment in named:
        writer, segment = raw_writer.decode(), int(raw_segment)
        if reach.get(writer, -1) < segment:
            reach[writer] = segment
    # The successes punched out of it, their ids kept beside it, name their journal segments as
    # their entries did: the ids go with the segment (docs/journal.md), so it stays until those do.
    for writer, segment in named_segments(ledger_dir(journal), writer_id, index):
        if reach.get(writer, -1) < segment:
            reach[writer] = segment
    return LedgerSegmentScan(reach, kept, decoded)
