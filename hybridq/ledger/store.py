"""The completion ledger: durable outcomes, so Redis losing a result never re-runs a finished job.

The ledger is a second journal (same format, same crash safety) in ``<journal>/ledger/``. The
forwarder appends what workers report, with fsync, before it deletes the events from Redis
(docs/reliability.md rule 13); :func:`requeue` appends from any process. Records are JSON objects with
a kind ``t``: :class:`Entry`, in :mod:`hybridq.ledger.entries` (the entry format, the kinds).

This module is the ledger's directories, writers and readers, and :func:`load_index`, which
replays the whole ledger into a :class:`LedgerIndex` (:mod:`hybridq.ledger.index`, the in-memory
index); counters of compacted segments are :class:`Compacted` (:mod:`hybridq.ledger.compacted`).
Every name of those modules that callers use is importable from here too.

This module must not import redis or rq.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator, Mapping

from hybridq.journal import ChainPosition, JournalReader, JournalWriter, Record, RecordType
from hybridq.journal.paths import ensure_journal_dir
from hybridq.journal.reader import list_chains
from hybridq.ledger.compacted import (
    COMPACTION_NAME,
    AcceptedCounter,
    Compacted,
    consistent,
    load_compacted,
    save_compacted,
)
from hybridq.ledger.entries import Entry, Seg, parse_event, parse_loc
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.keytable import UnreadKeys
from hybridq.ledger.punched_maps import collapse_punched

__all__ = [
    "COMPACTION_NAME",
    "LEDGER_DIR",
    "AcceptedCounter",
    "Compacted",
    "Entry",
    "LedgerIndex",
    "Seg",
    "consistent",
    "gone",
    "keys_dir",
    "ledger_dir",
    "load_compacted",
    "load_index",
    "open_keys_writer",
    "open_ledger_writer",
    "parse_event",
    "read_keys",
    "read_ledger",
    "read_ledger_failures",
    "read_ledger_of",
    "read_ledger_segment",
    "replay",
    "save_compacted",
]

#: The ledger's directory, inside the journal directory.
LEDGER_DIR = "ledger"
#: Ledger segments are small so that compaction frees space soon.
LEDGER_SEGMENT_BYTES = 4 << 20
#: The key store's directory, inside the journal directory, and its segment size.
KEYS_DIR = "keys"
KEYS_SEGMENT_BYTES = 1 << 20


def ledger_dir(journal: str) -> str:
    """The ledger directory of a journal directory."""
    return os.path.join(journal, LEDGER_DIR)


def open_ledger_writer(journal: str) -> JournalWriter:
    """A writer for this process's chain in the ledger (created 0700 when missing)."""
    path = ensure_journal_dir(ledger_dir(journal))
    return JournalWriter(path, max_segment_bytes=LEDGER_SEGMENT_BYTES)


def keys_dir(journal: str) -> str:
    """The key store directory of a journal directory (keys of finished jobs, in their window)."""
    return os.path.join(journal, KEYS_DIR)


def open_keys_writer(journal: str) -> JournalWriter:
    """A writer for this process's chain in the key store (created 0700 when missing)."""
    return JournalWriter(ensure_journal_dir(keys_dir(journal)), max_segment_bytes=KEYS_SEGMENT_BYTES)


def read_keys(journal: str) -> Iterator[tuple[Record, Entry]]:
    """Every entry of the key store (none if it does not exist yet)."""
    return _read_entries(keys_dir(journal))


def read_ledger(journal: str) -> Iterator[tuple[Record, Entry]]:
    """Every entry of the ledger (none if it does not exist yet). Garbled JSON is skipped."""
    return _read_entries(ledger_dir(journal))


def read_ledger_segment(journal: str, writer_id: str, index: int) -> list[Entry]:
    """The entries of one sealed ledger segment, each decoded whole.

    Compaction reads only what it needs of a segment (``ledger.segment_scan``); this full decode
    is what the tests hold that scan's answers against.
    """
    records = JournalReader(ledger_dir(journal)).segment_records(writer_id, index)
    return [entry for _, entry in _decoded(records)]


def read_ledger_failures(journal: str) -> Iterator[tuple[Record, Entry]]:
    """The ledger's failures and marks (requeued, outranked); every other entry is skipped undecoded.

    Compaction needs only those of the whole ledger, and after a long drain it holds a million
    successes: decoding (and keeping) them all made a compaction cost hundreds of MB.
    """
    path = ledger_dir(journal)
    if not os.path.isdir(path):
        return
    records = JournalReader(path).records()
    # Compact JSON never escapes ASCII letters: an entry without these bytes is neither (an
    # outranking success holds "over":"failed").
    wanted = (r for r in records if b"failed" in r.payload or b"requeued" in r.payload)
    yield from _decoded(wanted)


def read_ledger_of(journal: str, job_ids: Iterable[str]) -> Iterator[Entry]:
    """The ledger's entries of ``job_ids``; an entry naming none of them is skipped undecoded.

    For a reader looking a few jobs up (``cancel()``): decoding every entry of a long ledger
    costs it the most (as :func:`read_ledger_failures` avoids).
    """
    path = ledger_dir(journal)
    if not os.path.isdir(path):
        return
    ids = set(job_ids)
    needles = [b'"id":' + json.dumps(job_id).encode() for job_id in ids]
    wanted = (r for r in JournalReader(path).records() if any(n in r.payload for n in needles))
    for _, entry in _decoded(wanted):
        if entry.job_id in ids:
            yield entry


#: How many ledger records a replay folds in between two checks of the index's cap (one compare).
SPILL_CHECK_RECORDS = 4096


def _replayed(
    reader: JournalReader,
    since: Mapping[str, ChainPosition] | None,
    index: LedgerIndex,
    compacted: Compacted,
    first: dict[str, int],
) -> Iterator[Entry]:
    """The ledger's entries after ``since``, but successes of live segments applied here.

    Most of a ledger is ``done`` entries that succeeded: they are folded in from the parsed JSON
    (:meth:`LedgerIndex.apply_succeeded`) rather than built into an :class:`Entry` first. The
    index's cap is checked every :data:`SPILL_CHECK_RECORDS` records (:meth:`LedgerIndex.check_spill`):
    a replay past it spills as it goes, rather than holding every entry until the end.
    """
    for n, record in enumerate(reader.records(since), 1):
        if not n % SPILL_CHECK_RECORDS:
            index.check_spill()
        if record.rtype != RecordType.DATA:
            continue
        try:
            body = json.loads(record.payload)
            if (
                body.get("t") == "done"
                and body.get("o") == "succeeded"
                and not body.get("dup")
                and "over" not in body  # a mark, once its segment is compacted: built below
            ):
                writer, segment, offset = body["loc"]
                loc = (str(writer), int(segment), int(offset))
                # What Entry.from_body checks too: a record it would skip is skipped here.
                _ = (body["id"], int(body.get("n", 1)), float(body.get("at", 0.0)), int(body.get("lt", 0)))
                _ = int(body.get("g", 0)), None if (ol := body.get("ol")) is None else parse_loc(ol)
                if not gone(compacted, first, (loc[0], loc[1])):
                    index.apply_succeeded(loc)
                continue  # of a compacted segment: counted there already, and no mark
            entry = Entry.from_body(body)
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError):  # not an object; 1e400
            continue  # passed its checksum, so a bug: never a reason to stop counting the rest
        yield entry


def _read_entries(path: str) -> Iterator[tuple[Record, Entry]]:
    if not os.path.isdir(path):
        return
    yield from _decoded(JournalReader(path).records())


def _decoded(records: Iterable[Record]) -> Iterator[tuple[Record, Entry]]:
    for record in records:
        if record.rtype != RecordType.DATA:
            continue
        try:
            entry = Entry.from_bytes(record.payload)
        except (ValueError, KeyError, TypeError):
            continue  # passed its checksum, so a bug: never a reason to stop counting the rest
        yield record, entry


def load_index(journal: str, compacted: Compacted, keys: bool = True) -> LedgerIndex:
    """The index of the whole ledger; of compacted journal segments, only failures still listed.

    The journal's punched ranges stand for their succeeded jobs (:func:`collapse_punched`), as
    in the forwarder's index: the ledger may have lost those jobs' entries (docs/journal.md).

    ``keys=False``: without the owners of idempotency keys (:class:`UnreadKeys`), for a reader
    that never looks at them. The listed failures are kept either way, in a table in memory
    (:mod:`hybridq.ledger.failtable`): about 20 µs and 0.4 KB a failure (docs/reliability.md,
    the key table), for a short-lived reader; the forwarder's are on disk.
    """
    index = LedgerIndex() if keys else LedgerIndex(keys=UnreadKeys())
    with index.keys.bulk():  # its key owners written in key order, many at a time
        replay(journal, index, compacted)
    # The journal's punched ranges, read after the ledger: a success punched out of the ledger
    # (hybridq.forwarder.ledger_punch) had its range mapped first, so the range answers for it.
    collapse_punched(journal, index, compacted)
    return index


def replay(
    journal: str, index: LedgerIndex, compacted: Compacted, since: Mapping[str, ChainPosition] | None = None
) -> dict[str, ChainPosition]:
    """Fold the ledger's records after ``since`` (every one without it) into ``index``.

    Returns where each ledger chain ended as read (what an index saved later covers:
    :mod:`hybridq.ledger.saved_index`). Raises :class:`JournalCorruption` on damage.
    """
    path = ledger_dir(journal)
    if not os.path.isdir(path):
        return {}
    reader = JournalReader(path)
    first = {writer: indices[0] for writer, indices in list_chains(journal).items()}
    for entry in _replayed(reader, since, index, compacted, first):
        # A chain that is gone was compacted away whole (and may have been forgotten since); a
        # segment below its chain's first one was compacted too, even when the chain was
        # forgotten and then grew again (its writer sealed its last segment while compaction
        # ran, then rotated into a new one): its entries are counted in Compacted already.
        if gone(compacted, first, (entry.loc[0], entry.loc[1])):
            index.apply_compacted(entry)  # counted in Compacted already: marks, listed failures, keys
            continue
        index.apply(entry)
    return reader.position


def gone(compacted: Compacted, first: Mapping[str, int], seg: Seg) -> bool:
    """Whether journal segment ``seg`` was compacted (``first``: each journal chain's first index)."""
    return compacted.is_compacted(seg) or seg[1] < first.get(seg[0], sys.maxsize)
