"""The lookup index's file, for its writer (:mod:`hybridq.lookup.index`).

The schema and the statements that fold journal records and ledger entries into rows, the
connection, the marks (how far each journal and ledger chain was read into the index) and the
reading of the files past them. The names :mod:`hybridq.lookup.index` uses (``CHUNK``, the
statements it runs, the helpers) are importable from it too.

This module must not import redis or rq.
"""

from __future__ import annotations

import functools
import os
import sqlite3
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from hybridq.envelope.codec import dumps_ascii
from hybridq.journal import JournalReader, Record, RecordType
from hybridq.journal.format import FILE_HEADER_SIZE, segment_name
from hybridq.journal.holes import HoleMaps
from hybridq.journal.reader import list_chains
from hybridq.journal.records import ChainPosition
from hybridq.ledger.entries import Entry
from hybridq.lookup.reads import readable_marks, sql_text
from hybridq.protocol import EntryKind, Outcome

__all__ = ["CHUNK"]

#: Rows (or ledger entries) per transaction when the index reads the files.
CHUNK = 10000
T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, writer TEXT NOT NULL, seg INTEGER NOT NULL, off INTEGER NOT NULL,
    seq INTEGER NOT NULL, requeue INTEGER NOT NULL, enq REAL, func TEXT, queue TEXT, ikey TEXT,
    state TEXT, outcome TEXT, attempt INTEGER NOT NULL DEFAULT 0, started REAL, ended REAL,
    result TEXT, rkept INTEGER NOT NULL DEFAULT 0, rbytes INTEGER, error TEXT, dup_of TEXT
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS marks (chain TEXT PRIMARY KEY, seg INTEGER, off INTEGER, seq INTEGER);
CREATE TABLE IF NOT EXISTS ahead (entry BLOB NOT NULL);
"""
# ``ahead``: ledger entries about journal records the forwarder has not read yet (a cancel of a
# job in a backlog it is still reading): they would update no row. Kept with the rows, so a crash
# keeps them too, and applied once the record's row is in (LookupIndex._apply_ahead).
# A record read from the journal: a new id, or a requeue (a higher requeue count) taking the id
# over with a clean slate. The first record under an id keeps it against later ones (merged).
_UPSERT_JOB = """
INSERT INTO jobs (id, writer, seg, off, seq, requeue, enq, func, queue, ikey)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (id) DO UPDATE SET writer = excluded.writer, seg = excluded.seg, off = excluded.off,
    seq = excluded.seq, requeue = excluded.requeue, enq = excluded.enq, func = excluded.func,
    queue = excluded.queue, ikey = excluded.ikey, state = NULL,
    outcome = NULL, attempt = 0, started = NULL, ended = NULL, result = NULL, rkept = 0,
    rbytes = NULL, error = NULL, dup_of = NULL
WHERE excluded.requeue > jobs.requeue
"""
_ONE_JOB = "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
#: Job rows per ``_UPSERT_JOB`` statement at most. Each statement's run ends by freeing its
#: registers (this SQLite allocates each anew: no lookaside), so rows one per statement
#: (``executemany``) cost about 4k instructions a row more than rows many per statement
#: (docs/benchmarks.md, "The lookup index's rows many per statement"). 64 rows bind 640 values,
#: under SQLite's oldest limit of 999.
ROWS_PER_UPSERT = 64


@functools.cache
def _upsert_sql(rows: int) -> str:
    """``_UPSERT_JOB`` for ``rows`` rows, in their order (a later row meets the earlier ones)."""
    return _UPSERT_JOB.replace(_ONE_JOB, ", ".join([_ONE_JOB] * rows))


def _upsert_jobs(db: sqlite3.Connection, rows: Sequence[tuple[Any, ...]]) -> None:
    """Upsert the job ``rows`` in order, in statements of :data:`ROWS_PER_UPSERT` rows, then powers of two.

    The statements are a handful (seven sizes), so they stay prepared in sqlite3's cache.
    """
    i = 0
    while i < len(rows):
        n = min(ROWS_PER_UPSERT, 1 << ((len(rows) - i).bit_length() - 1))
        db.execute(_upsert_sql(n), [value for row in rows[i : i + n] for value in row])
        i += n


# A terminal outcome: the first one wins, but as in the ledger (hybridq.ledger.index._RANK) a success
# beats a failure and either beats a cancel the forwarder settled meanwhile (a run that reported
# after all), and a success with its result beats one without (a run's event whose success was
# kept from another run carries none).
# What the statement's text can say is written there, not bound: sqlite3 copies each text bound
# (about 800 instructions a text: docs/benchmarks.md, "The forwarder's writes per job, again", and
# "The lookup index's rows many per statement"). So the result's ``rkept`` is a literal, and so
# are an outcome of the protocol's (``{new}``, a text of its own vocabulary) and a result ``null``;
# an outcome bound is ``?1`` (the first ``?``) again in the conditions.
_DONE = """
UPDATE jobs SET state = 'done', outcome = {outcome}, attempt = max(attempt, ?),
    started = coalesce({started}, started), ended = ?, result = {result}, rkept = {kept},
    rbytes = {rbytes}, error = {error}, dup_of = coalesce({dup_of}, dup_of)
WHERE id = ? AND writer = ? AND seg = ? AND off = ? AND (state IS NOT 'done'
    OR (outcome = 'failed' AND {new} = 'succeeded')
    OR (outcome = 'cancelled' AND {new} IN ('succeeded', 'failed'))
    OR (outcome = 'succeeded' AND rkept = 0 AND rbytes IS NULL AND {new} = 'succeeded' AND {kept} = 1))
"""
#: The columns of ``_DONE`` that are often NULL. Each is bound as ``?`` when it has a value and
#: written ``NULL`` in the statement when it has none: sqlite3 binds None through its adapter
#: lookup, which fails with an exception formatted and cleared (about 3k instructions a value,
#: three a succeeded job: docs/benchmarks.md, "Fewer writes per job").
_NULLABLE = ("started", "result", "rbytes", "error", "dup_of")
#: ``EntryKind.DONE``, read once: a member read from its Enum class goes through ``EnumType.__getattr__``'s
#: hook on Python 3.11 (about 900 instructions a read, once per job here: docs/benchmarks.md,
#: "The forwarder's writes per job, again").
_DONE_KIND = EntryKind.DONE
#: ``dumps_ascii(None)``.
_NULL = "null"
#: ``Outcome.SUCCEEDED`` as a plain str, read once (a member read from its class: see ``_DONE_KIND``).
_OK = Outcome.SUCCEEDED.value
#: The outcomes written in the statement's text (plain words: no quote to escape).
_OUTCOMES = frozenset(str(o) for o in Outcome)
#: A done statement's shape: its outcome (``None``: bound), whether its result is kept, and per
#: nullable column (``_NULLABLE`` order) ``None`` (NULL), ``_NULL`` (the text ``null``) or ``""`` (bound).
Shape = tuple[str | None, bool, str | None, str | None, str | None, str | None, str | None]
#: A success as a burn's no-op jobs have it: started known, its result ``None`` kept, the rest none.
_SUCCEEDED: Shape = ("succeeded", True, "", _NULL, None, None, None)


@functools.cache
def _done_sql(shape: Shape) -> str:
    """``_DONE`` for entries of ``shape`` (:data:`Shape`)."""
    outcome, kept, *columns = shape
    slots = {
        name: "NULL" if value is None else "'null'" if value == _NULL else "?"
        for name, value in zip(_NULLABLE, columns, strict=True)
    }
    new = "?1" if outcome is None else f"'{outcome}'"
    return _DONE.format(outcome="?" if outcome is None else new, new=new, kept=int(kept), **slots)


# A failed run with a retry to come: ``ended`` holds when it failed (the retrying list's "last
# failed at", docs/dashboard.md) until a run starts or an outcome is known.
_RETRY = """
UPDATE jobs SET state = 'retry', attempt = max(attempt, ?), started = coalesce(?, started), error = ?,
    ended = ?
WHERE id = ? AND writer = ? AND seg = ? AND off = ? AND state IS NOT 'done'
"""
_LOST = """
UPDATE jobs SET attempt = max(attempt, ?), state = nullif(state, 'started')
WHERE id = ? AND writer = ? AND seg = ? AND off = ? AND state IS NOT 'done'
"""
# A run claimed (a started event): a job with no outcome yet, or waiting for the run after a
# failed one. Never over an outcome: it changes none. Applied after the ledger entries noted
# with it, none of them newer (a newer entry for its job drops it: LookupIndex.note_entries).
_STARTED = """
UPDATE jobs SET state = 'started', attempt = max(attempt, ?), started = ?, ended = NULL
WHERE id = ? AND writer = ? AND seg = ? AND off = ? AND (state IS NULL OR state IN ('retry', 'started'))
"""
_DUPLICATE = """
UPDATE jobs SET state = 'dup', dup_of = ?
WHERE id = ? AND writer = ? AND seg = ? AND off = ? AND state IS NOT 'done'
"""


# The row of a finished job whose record was punched (hybridq.journal.holes): as the ledger's
# ``done`` entry knows it (id, location, queue), without its function or arguments. ``seq`` is the
# first of its punched run's (a lower bound: the record's own is gone). A row read from the
# journal wins; a requeued job's records are never punched, so its newest is read (docs/guarantees.md).
_BARE = "INSERT OR IGNORE INTO jobs (id, writer, seg, off, seq, requeue, queue) VALUES (?, ?, ?, ?, ?, 0, ?)"


def _bare_rows(db: sqlite3.Connection, journal: str, entries: Iterable[Entry]) -> None:
    """Rows for the ``done`` entries of punched records, which a build of the index does not read.

    A punched segment is sealed and still on disk, so a rebuilt index (``lookup/`` deleted, or
    its marks taken back by a power loss) answers for its finished jobs as before the punch,
    not as for a compacted one (docs/journal-format.md, the ``lookup/`` row).
    """
    maps = HoleMaps(journal)
    rows = []
    for e in entries:
        if e.kind != EntryKind.DONE:
            continue
        hole = maps.hole_at(*e.loc)
        if hole is not None:
            rows.append((e.job_id, *e.loc, hole.first_seq, e.queue))
    if rows:
        db.executemany(_BARE, rows)


def _connect(path: str) -> sqlite3.Connection:
    # Private, as every journal file (it holds results): SQLite makes its -wal and -shm files
    # with the database file's mode, whatever the umask.
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    os.chmod(path, 0o600)
    db = sqlite3.connect(path, timeout=5.0, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=OFF")  # derived data: rebuilt, never trusted over the ledger
    db.isolation_level = "DEFERRED"
    return db


def _moved(marks: Mapping[str, tuple[int, int, int]], *ends: Mapping[str, ChainPosition]) -> bool:
    now = {f"{k}:{w}": tuple(p) for k, end in zip("jl", ends, strict=True) for w, p in end.items()}
    return now != dict(marks)


def _save_marks(
    db: sqlite3.Connection,
    journal: Mapping[str, tuple[int, int, int]],
    ledger: Mapping[str, tuple[int, int, int]],
) -> None:
    db.execute("DELETE FROM marks")
    db.executemany(
        "INSERT INTO marks VALUES (?, ?, ?, ?)",
        [(f"j:{w}", *p) for w, p in journal.items()] + [(f"l:{w}", *p) for w, p in ledger.items()],
    )


def _load_marks(db: sqlite3.Connection) -> dict[str, tuple[int, int, int]]:
    return {chain: (seg, off, seq) for chain, seg, off, seq in db.execute("SELECT * FROM marks")}


class _Tail:
    """The records of a journal directory past ``marks``, read as they are iterated.

    ``until``: only the chains it names, each up to that position (``None``: every chain whole).
    """

    def __init__(
        self,
        path: str,
        marks: Mapping[str, tuple[int, int, int]],
        until: Mapping[str, ChainPosition] | None = None,
    ) -> None:
        self.path = path
        self.marks = marks
        self.until = until
        self.reader = JournalReader(path) if os.path.isdir(path) else None
        #: Records yielded so far.
        self.count = 0

    def __iter__(self) -> Iterator[Record]:
        if self.reader is None:
            return
        for record in self.reader.records(readable_marks(self.path, self.marks), self.until):
            if record.rtype == RecordType.DATA:
                self.count += 1
                yield record

    def end(self) -> dict[str, ChainPosition]:
        """Per chain still there, where the iteration stopped."""
        if self.reader is None:
            return {}
        chains = list_chains(self.path)
        return {w: p for w, p in self.reader.position.items() if w in chains}


def _read_all(
    path: str, marks: Mapping[str, tuple[int, int, int]], noted: Iterable[str]
) -> dict[str, ChainPosition] | None:
    """The chains' ends if nothing is past ``marks`` in the ledger ``path``; else ``None`` (read it).

    Each chain must end in its mark's segment (or be read to the end of its sealed last one: the
    mark at the next segment's header); one not ``noted`` (another writer's: its entries
    are read from the file) must end at its mark's offset too (one ``stat``). Tells, without a
    reader, that a catch-up has nothing of the files to read (docs/benchmarks.md, "Fewer writes
    per job"); a torn tail or anything else unsure answers ``None``, and the files are read.
    """
    if not os.path.isdir(path):
        return {}
    own = set(noted)
    ends: dict[str, ChainPosition] = {}
    for writer, indices in list_chains(path).items():
        mark = marks.get(writer)
        if mark is not None and mark[0] == indices[-1] + 1 and mark[1] == FILE_HEADER_SIZE:
            # Read to the end of its sealed last segment (a chain a stopped forwarder left, say):
            # a new entry would be in a new segment, which moves its last index.
            ends[writer] = ChainPosition(*mark)
            continue
        if mark is None or mark[0] != indices[-1]:
            return None
        if writer not in own:
            try:
                size = os.stat(os.path.join(path, segment_name(writer, indices[-1]))).st_size
            except FileNotFoundError:
                return None
            if size != mark[1]:
                return None
        ends[writer] = ChainPosition(*mark)
    return ends


def _entries(records: Iterable[Record]) -> Iterator[Entry]:
    """The ledger entries of ``records`` the index uses."""
    for record in records:
        if b'"t":"key"' in record.payload[:12]:
            continue  # nothing for the index
        try:
            yield Entry.from_bytes(record.payload)
        except (ValueError, KeyError, TypeError):
            continue


def _chunks(items: Iterable[T], size: int = CHUNK) -> Iterator[list[T]]:
    chunk: list[T] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _stash(db: sqlite3.Connection, entries: Iterable[Entry]) -> None:
    """Keep ``entries`` until the rows of their records are in (see ``ahead`` in the schema)."""
    db.executemany("INSERT INTO ahead (entry) VALUES (?)", [(e.to_bytes(),) for e in entries])


def _stashed(db: sqlite3.Connection) -> list[tuple[int, Entry]]:
    """The entries kept by :func:`_stash`, in the order kept, with their row ids."""
    rows = db.execute("SELECT rowid, entry FROM ahead ORDER BY rowid").fetchall()
    return [(rowid, Entry.from_bytes(raw)) for rowid, raw in rows]


def _apply(db: sqlite3.Connection, entries: Iterable[Entry]) -> None:
    """Fold ledger entries into the rows, one statement per kind (any order folds alike)."""
    # The done rows in their order (two outcomes of one job: the first wins among equals), a
    # statement per run of entries of the same shape (in a burn: one run, every job succeeded
    # alike), each run's rows gathered as they come (no second pass comparing them).
    runs: list[tuple[Shape, list[tuple[Any, ...]]]] = []
    rows: list[tuple[Any, ...]] = []
    last: Shape | None = None
    retry, lost, dup = [], [], []
    for e in entries:
        if e.kind == _DONE_KIND:
            attempt = max(0, e.attempt - e.later)
            started, plain = e.started, e.result is None and e.result_bytes is None and e.error is None
            if plain and e.dup_of is None and e.result_kept and started is not None and e.outcome == _OK:
                shape: Shape = _SUCCEEDED  # (nearly every entry of a burn)
                params: tuple[Any, ...] = (attempt, started, e.at, e.job_id, *e.loc)
            else:
                shape, params = _done_row(e, attempt)
            if shape != last:
                rows, last = [], shape
                runs.append((shape, rows))
            rows.append(params)
            continue
        where = (e.job_id, *e.loc)
        if e.kind == EntryKind.RETRY:
            retry.append((max(0, e.attempt - e.later), e.started, sql_text(e.error), e.at, *where))
        elif e.kind == EntryKind.LOST:
            lost.append((e.attempt, *where))
        elif e.kind == EntryKind.DUPLICATE:
            dup.append((e.dup_of, *where))
    for sql, kind_rows in ((_RETRY, retry), (_LOST, lost), (_DUPLICATE, dup)):
        if kind_rows:
            db.executemany(sql, kind_rows)
    for shape, run in runs:
        db.executemany(_done_sql(shape), run)


def _done_row(e: Entry, attempt: int) -> tuple[Shape, tuple[Any, ...]]:
    """A done entry's statement shape (:data:`Shape`) and its values bound, in their order."""
    # A plain str: an Outcome (a str subclass) would be bound through the adapter lookup too.
    outcome = str(e.outcome or "failed")
    literal = outcome if outcome in _OUTCOMES else None
    # json.dumps's text without the encoder it builds per call (~1.5 us of each done entry);
    # a task's None (a burn's no-op jobs, many tasks') without the encoder at all.
    result = (_NULL if e.result is None else dumps_ascii(e.result)) if e.result_kept else None
    started, rbytes, error, dup_of = e.started, e.result_bytes, sql_text(e.error), e.dup_of
    shape: Shape = (
        literal,
        e.result_kept,
        None if started is None else "",
        None if result is None else _NULL if result == _NULL else "",
        None if rbytes is None else "",
        None if error is None else "",
        None if dup_of is None else "",
    )
    bound = [None if literal else outcome, attempt, started, e.at, None if result == _NULL else result]
    values = [v for v in (*bound, rbytes, error, dup_of) if v is not None]
    return shape, (*values, e.job_id, *e.loc)
