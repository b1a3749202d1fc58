"""Jobs by id: the reads behind ``hybridq.fetch_job`` of the index the forwarder keeps.

The index is a SQLite file, ``<journal>/lookup/index.sqlite`` (WAL mode), with one row per job
id: where its record is in the journal, and what the ledger says of it (state, attempt, times,
the result or its size, the error, the original of a duplicate). It is derived data: the
forwarder (:class:`hybridq.lookup.index.LookupIndex`) brings it up to date from what it read
from the journal and appended to the ledger after each step that moved something, and reads
the files for the rest (at start, other writers' ledger chains), from marks saved with the rows.
A lost or damaged index file is rebuilt from the journal and the ledger, which stay the durable
truth; it is never fsync'd.

A lookup is a primary-key read (O(log n)). It lags the ledger by at most one forwarder step;
a record the index has not read yet (the forwarder is behind, or down) is found by reading the
journal past the index's marks (:func:`scan_tail`).

Retention: a row outlives its journal segment's compaction by :data:`RETENTION_S`, counted from
the job's end; the result, status and times stay readable from the index alone meanwhile (the
ledger entry that carried the result is compacted with its segment).

This module must not import redis or rq.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hybridq.journal import JournalReader, Record, RecordType
from hybridq.journal.format import segment_name
from hybridq.journal.reader import list_chains
from hybridq.journal.records import ChainPosition

__all__ = [
    "COLUMNS",
    "INDEX_DIR",
    "INDEX_FILE",
    "RETENTION_S",
    "Row",
    "find",
    "find_checked",
    "index_path",
    "job_row",
    "journal_marks",
    "query",
    "readable_marks",
    "recent",
    "scan_tail",
    "segment_gone",
    "sql_text",
]

#: The index's directory inside the journal directory, and its file.
INDEX_DIR = "lookup"
INDEX_FILE = "index.sqlite"
#: How long a job stays found by id after its journal segment was compacted, from its end (s).
RETENTION_S = 7 * 86400.0

_decode = json.JSONDecoder().decode


def sql_text(text: str | None) -> str | None:
    """``text`` as SQLite can hold it: a lone surrogate escaped (``\\udcff``, six characters).

    JSON carries a lone surrogate (``os.fsdecode`` of a file name that is not UTF-8 gives one),
    and an idempotency key or an error may hold one; sqlite3 encodes every str as strict UTF-8,
    so the index's update raised, and the forwarder exited at every start (issue 26, item 4).
    """
    if text is None or text.isascii():
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text


COLUMNS = (
    "SELECT id, writer, seg, off, seq, requeue, enq, func, queue, ikey, state, outcome, attempt, started,"
    " ended, result, rkept, rbytes, error, dup_of FROM jobs"
)
_SELECT = COLUMNS + " WHERE id = ?"
# Newest first: a scan with a top-N sort (no index on enq: the forwarder's writes stay as they
# are); about 20 ms for the first page of 200,000 rows, 35 ms 5,000 rows in.
_RECENT = COLUMNS + " ORDER BY enq DESC, id DESC LIMIT ? OFFSET ?"


@dataclass(frozen=True, slots=True)
class Row:
    """What the index holds of one job id."""

    id: str
    writer: str
    seg: int
    off: int
    seq: int
    requeue: int
    enq: float | None
    func: str | None
    queue: str | None
    ikey: str | None
    #: ``None`` (no ledger entry yet), ``retry``, ``dup`` (waiting for its key's owner) or ``done``.
    state: str | None
    outcome: str | None
    attempt: int
    started: float | None
    #: When it ended (``done``), or when its last run failed (``retry``: a retry to come).
    ended: float | None
    #: The result's JSON text, if kept (``rkept``); else the size of one too large (``rbytes``).
    result: str | None
    rkept: int
    rbytes: int | None
    error: str | None
    dup_of: str | None

    @property
    def loc(self) -> tuple[str, int, int]:
        """The job's record in the journal."""
        return (self.writer, self.seg, self.off)


def index_path(journal: str) -> str:
    """The index file of a journal directory."""
    return os.path.join(journal, INDEX_DIR, INDEX_FILE)


def readable_marks(path: str, marks: Mapping[str, tuple[int, int, int]]) -> dict[str, ChainPosition]:
    """The marks of chains still there, from where they are still readable (compaction cuts heads)."""
    chains = list_chains(path)
    out: dict[str, ChainPosition] = {}
    for writer, (seg, off, seq) in marks.items():
        indices = chains.get(writer)
        if indices and seg >= indices[0]:
            out[writer] = ChainPosition(seg, off, seq)
    return out


def job_row(record: Record) -> tuple[Any, ...] | None:
    """The row of a journal record (id, loc, seq, requeue, enqueue time); ``None``: not a job."""
    try:
        body = _decode(record.payload.decode())
        job_id = body["id"]
        if not isinstance(job_id, str):
            return None
        requeue = int(body.get("requeue", 0))
        if not 0 <= requeue < 2**31:  # what an envelope may hold (and SQLite can store)
            return None
        created = body.get("created_at")
        enq = float(created) if isinstance(created, int | float) else None
        func, queue, key = (
            v if isinstance(v, str) else None for v in (body.get("func"), body.get("queue"), body.get("key"))
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return (
        job_id,
        record.writer_id,
        record.segment_index,
        record.offset,
        record.seq,
        requeue,
        enq,
        func,
        queue,
        sql_text(key),
    )


# -- the readers' side ----------------------------------------------------------------------------

_local = threading.local()


def _reader(journal: str) -> sqlite3.Connection | None:
    """This thread's connection to ``journal``'s index (``None`` while there is no index).

    A connection is made again when the file was replaced (a rebuild) or after a fork.
    """
    conns: dict[tuple[int, str], tuple[sqlite3.Connection, int]] = _local.__dict__.setdefault("conns", {})
    key = (os.getpid(), journal)
    path = index_path(journal)
    try:
        inode = os.stat(path).st_ino
    except FileNotFoundError:
        inode = -1
    known = conns.get(key)
    if known is not None and known[1] == inode:
        return known[0]
    if known is not None:
        known[0].close()
        del conns[key]
    if inode == -1:
        return None
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0, check_same_thread=False)
    except sqlite3.Error:
        return None  # not readable here: the callers read the journal and the ledger instead
    db.create_function("casefold_in", 2, _casefold_in, deterministic=True)
    conns[key] = (db, inode)
    return db


def _casefold_in(needle: str, text: str | None) -> bool:
    """SQL ``casefold_in(needle, text)``: ``needle`` (casefolded already) is in ``text``, in any case.

    What the dashboard's error filter means (SQLite's own ``lower`` folds ASCII letters only).
    """
    return needle in (text or "").casefold()


def _drop(journal: str) -> None:
    known = _local.__dict__.get("conns", {}).pop((os.getpid(), journal), None)
    if known is not None:
        known[0].close()


def find(journal: str, job_id: str) -> Row | None:
    """The index's row for ``job_id``; ``None`` if it has none (or there is no index yet)."""
    db = _reader(journal)
    if db is None:
        return None
    try:
        found = db.execute(_SELECT, (job_id,)).fetchone()
    except sqlite3.Error:
        _drop(journal)
        return None  # being rebuilt, or not there yet: the caller reads the journal instead
    return Row(*found) if found is not None else None


def recent(journal: str, limit: int, offset: int = 0) -> tuple[int, list[Row]] | None:
    """How many jobs the index holds, and ``limit`` of them from ``offset``, newest first.

    By acceptance time (``created_at``): what the forwarder has read, and not yet forgotten
    (:data:`RETENTION_S` after a compacted job ended). ``None``: no index (yet), or it cannot be
    read now (being rebuilt).
    """
    db = _reader(journal)
    if db is None:
        return None
    try:
        (total,) = db.execute("SELECT count(*) FROM jobs").fetchone()
        rows = db.execute(_RECENT, (limit, offset)).fetchall()
    except sqlite3.Error:
        _drop(journal)
        return None
    return int(total), [Row(*row) for row in rows]


def query(journal: str, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]] | None:
    """The rows of a read-only ``sql`` over the index (its columns as :data:`COLUMNS` names them).

    ``None``: no index (yet), or it cannot be read now (being rebuilt): the caller says so.
    """
    db = _reader(journal)
    if db is None:
        return None
    try:
        return db.execute(sql, params).fetchall()
    except sqlite3.Error:
        _drop(journal)
        return None


def find_checked(journal: str, job_id: str) -> tuple[dict[str, ChainPosition], Row | None] | None:
    """Like :func:`find`, telling a miss from an index that could not be read.

    The marks are read before the row, on one connection: the row's answer covers at least the
    journal up to those marks (an index only moves its marks forward).

    Returns:
        ``(marks, row)``: per journal chain where the index stopped reading it, and its row for
        ``job_id`` (``None``: it has none); ``None``: no index, or it could not be read (being
        rebuilt, busy, damaged).
    """
    db = _reader(journal)
    if db is None:
        return None
    try:
        rows = db.execute("SELECT chain, seg, off, seq FROM marks WHERE chain LIKE 'j:%'").fetchall()
        found = db.execute(_SELECT, (job_id,)).fetchone()
    except sqlite3.Error:
        _drop(journal)
        return None
    marks = {chain[2:]: ChainPosition(seg, off, seq) for chain, seg, off, seq in rows}
    return marks, Row(*found) if found is not None else None


def journal_marks(journal: str) -> dict[str, ChainPosition] | None:
    """Per journal chain, where the index stopped reading it; ``None`` if there is no index."""
    db = _reader(journal)
    if db is None:
        return None
    try:
        rows = db.execute("SELECT chain, seg, off, seq FROM marks WHERE chain LIKE 'j:%'").fetchall()
    except sqlite3.Error:
        _drop(journal)
        return None
    return {chain[2:]: ChainPosition(seg, off, seq) for chain, seg, off, seq in rows}


def scan_tail(journal: str, job_id: str, marks: Mapping[str, ChainPosition] | None) -> Record | None:
    """The newest record of ``job_id`` past ``marks`` (what the index has not read yet).

    It costs as much as the journal holds past the marks: little while the forwarder keeps up.
    """
    needle = f'"id":"{job_id}"'.encode()
    found: Record | None = None
    for record in JournalReader(journal).records(readable_marks(journal, marks or {})):
        if record.rtype == RecordType.DATA and needle in record.payload:
            row = job_row(record)
            if row is not None and row[0] == job_id and (found is None or row[5] > _requeue(found)):
                found = record
    return found


def _requeue(record: Record) -> int:
    row = job_row(record)
    return row[5] if row is not None else 0


def segment_gone(journal: str, loc: Iterable[Any]) -> bool:
    """Whether the journal segment holding ``loc`` is gone (compacted)."""
    writer, seg, _ = loc
    return not os.path.exists(os.path.join(journal, segment_name(writer, seg)))
