"""The ids of jobs whose ``done`` entries were punched out of a ledger segment (issue 29).

A job whose journal record was punched (its segment pinned by a waiting job) is named only by
its ledger ``done`` entry, and ``cancel()`` and a rebuilt lookup index (so ``fetch_job`` and
``depends_on``) answer "succeeded" for it from that entry (docs/journal.md, "Entries punched out
of pinned ledger segments"). That entry is about 190 bytes; what those answers need is the id,
where its record was, its queue and when it ended: this file keeps just that, about 22 bytes a
job, so the
entry itself can be punched. One state file per ledger segment, ``<segment>.ids.state`` beside
it in the ledger directory (atomic and fsync'd: :mod:`hybridq.journal.statefile`), written by
:mod:`hybridq.forwarder.ledger_punch` before the segment's hole map (docs/reliability.md rule 8:
a crash between them leaves an id in both, which every reader folds into one). It goes with
its segment: a repair that removes the segment removes it too, after it; a file whose segment is
gone otherwise is removed by the next punch pass (one left meanwhile
names only jobs of compacted journal segments, which no reader answers from: they are not in a
punched range).

Only successes whose result is ``None`` (or not kept) are kept this way
(:func:`hybridq.ledger.punch_select.kept_by_id`): the row rebuilt from it is the one the entry
would have built but for the run's start time, its end's fraction of a second and its
attempt count. A success with a result keeps its entry (its result is answered from it).

Payload (varints unsigned LEB128): ``b"I1"``; the count of journal segments, each a
length-prefixed UTF-8 writer id and its segment index; the count of queue names, each
length-prefixed; the earliest end (whole seconds since the epoch); then per job: its segment's
number in that table, its record's offset, its queue's number, when it ended (seconds after the
earliest end), a flag byte (bit 0: the result
was kept, ``None``; bit 1: the id is 32 lowercase hex digits, stored as 16 bytes; otherwise a
length-prefixed UTF-8 id), the id.

This module must not import redis or rq.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from hybridq.errors import StateFileCorrupt
from hybridq.journal.format import parse_segment_name, segment_name
from hybridq.journal.holes import IDS_SUFFIX
from hybridq.journal.records import Loc
from hybridq.journal.statefile import STATE_SUFFIX, read_state, write_state
from hybridq.ledger.entries import Entry, Seg

__all__ = [
    "IDS_SUFFIX",
    "PunchedId",
    "damaged_ids",
    "decode_payload",
    "find_punched",
    "ids_files",
    "named_segments",
    "read_ids",
    "read_payload",
    "remove_orphans",
    "write_ids",
]

# The one line a damaged ids file answers with: what to do (docs/journal.md, "Entries punched out
# of pinned ledger segments"; docs/journal-format.md, "Backups and copies").
_DAMAGED = (
    "restore it with its ledger segment from a backup, or run `hybridq journal repair --accept-loss` "
    "to move it aside (its jobs then answer as compacted ones: cancel() unknown, no lookup row "
    "after a rebuild; none runs again)"
)
_MAGIC = b"I1"
_RESULT_KEPT = 1
_HEX = 2
_HEXDIGITS = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True)
class PunchedId:
    """A finished job whose ``done`` entry was punched: what a reader answers it from."""

    job_id: str
    loc: Loc
    queue: str | None
    result_kept: bool
    #: When it ended, to the second (the entry's ``at``: the lookup row's end and retention).
    at: int

    @classmethod
    def of(cls, entry: Entry) -> PunchedId:
        """What is kept of a ``done`` entry that :func:`~hybridq.ledger.punch_select.kept_by_id` allows."""
        return cls(entry.job_id, entry.loc, entry.queue, entry.result_kept, round(entry.at))

    def entry(self) -> Entry:
        """The ``done`` entry a reader folds in for it (a success, attempt 1, no start time)."""
        return Entry(
            "done",
            self.job_id,
            self.loc,
            outcome="succeeded",
            queue=self.queue,
            result_kept=self.result_kept,
            at=float(self.at),
        )


def _name(writer_id: str, index: int) -> str:
    return segment_name(writer_id, index) + IDS_SUFFIX


def _read(ledger: str, name: str) -> bytes | None:
    """The payload of ids file ``name`` (no state suffix), None when absent; damage says what to do."""
    try:
        return read_state(ledger, name)
    except StateFileCorrupt as exc:
        raise StateFileCorrupt(exc.path, f"{exc.reason}; {_DAMAGED}") from exc


def _varint(out: bytearray, n: int) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _text(out: bytearray, s: str) -> None:
    raw = s.encode()
    _varint(out, len(raw))
    out += raw


def encode(ids: Iterable[PunchedId]) -> bytes:
    """The payload of an ids file (see the module docstring)."""
    ids = list(ids)
    base = min((max(0, p.at) for p in ids), default=0)
    segs: dict[tuple[str, int], int] = {}
    queues: dict[str, int] = {}
    body = bytearray()
    for p in ids:
        seg = segs.setdefault((p.loc[0], p.loc[1]), len(segs))
        queue = queues.setdefault(p.queue or "", len(queues))
        _varint(body, seg)
        _varint(body, p.loc[2])
        _varint(body, queue)
        _varint(body, max(0, p.at) - base)
        hexid = len(p.job_id) == 32 and set(p.job_id) <= _HEXDIGITS
        body.append((_RESULT_KEPT if p.result_kept else 0) | (_HEX if hexid else 0))
        if hexid:
            body += bytes.fromhex(p.job_id)
        else:
            _text(body, p.job_id)
    out = bytearray(_MAGIC)
    _varint(out, len(segs))
    for writer_id, index in segs:
        _text(out, writer_id)
        _varint(out, index)
    _varint(out, len(queues))
    for queue_name in queues:
        _text(out, queue_name)
    _varint(out, base)
    return bytes(out + body)


class _Reader:
    def __init__(self, raw: bytes) -> None:
        self.raw, self.at = raw, 0

    def varint(self) -> int:
        n = shift = 0
        while True:
            byte = self.raw[self.at]
            self.at += 1
            n |= (byte & 0x7F) << shift
            if byte < 0x80:
                return n
            shift += 7

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.raw):
            raise IndexError("cut short")
        out = self.raw[self.at : self.at + n]
        self.at += n
        return out

    def text(self) -> str:
        return self.take(self.varint()).decode()


def _header(r: _Reader) -> tuple[list[Seg], list[str], int]:
    if r.raw[:2] != _MAGIC:
        raise ValueError(f"not an ids file: {r.raw[:2]!r}")
    r.at = 2
    segs = [(r.text(), r.varint()) for _ in range(r.varint())]
    return segs, [r.text() for _ in range(r.varint())], r.varint()


def decode(raw: bytes) -> list[PunchedId]:
    """The ids of a payload written by :func:`encode`; raises ``ValueError`` on garbled bytes."""
    r = _Reader(raw)
    try:
        segs, queues, base = _header(r)
        out = []
        while r.at < len(raw):
            writer_id, index = segs[r.varint()]
            offset, queue, at = r.varint(), queues[r.varint()], base + r.varint()
            flags = r.take(1)[0]
            job_id = r.take(16).hex() if flags & _HEX else r.text()
            loc = (writer_id, index, offset)
            out.append(PunchedId(job_id, loc, queue or None, bool(flags & _RESULT_KEPT), at))
    except (IndexError, UnicodeDecodeError) as exc:
        raise ValueError(f"garbled ids file: {exc}") from exc
    return out


def read_ids(ledger: str, writer_id: str, index: int) -> list[PunchedId]:
    """The ids kept for ledger segment ``(writer_id, index)``; empty when it has no ids file.

    Raises :class:`StateFileCorrupt` when the file is damaged (never read as "none").
    """
    payload = read_payload(ledger, writer_id, index)
    return [] if payload is None else decode_payload(ledger, writer_id, index, payload)


def read_payload(ledger: str, writer_id: str, index: int) -> bytes | None:
    """The checked bytes of segment ``(writer_id, index)``'s ids file, None when it has none.

    Raises :class:`StateFileCorrupt` when its checksum or frame is damaged.
    """
    return _read(ledger, _name(writer_id, index))


def decode_payload(ledger: str, writer_id: str, index: int, payload: bytes) -> list[PunchedId]:
    """:func:`decode` of that file's payload; :class:`StateFileCorrupt` naming it when garbled."""
    try:
        return decode(payload)
    except ValueError as exc:
        raise StateFileCorrupt(os.path.join(ledger, _name(writer_id, index)), f"{_DAMAGED}: {exc}") from exc


def named_segments(ledger: str, writer_id: str, index: int) -> list[Seg]:
    """The journal segments whose records the ids kept for ledger segment ``(writer_id, index)`` name.

    Its ledger segment is deleted only once they are (``hybridq.ledger.segment_scan``): the ids
    go with it. The file is the only record of those jobs, so a damaged one raises
    :class:`StateFileCorrupt` (as a damaged hole map does, docs/reliability.md rule 12): read as
    "names none", it would let the segment and the file go early.
    """
    path = os.path.join(ledger, _name(writer_id, index))
    payload = _read(ledger, _name(writer_id, index))
    if payload is None:
        return []
    try:
        return _header(_Reader(payload))[0]
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise StateFileCorrupt(path, f"{_DAMAGED}: {exc}") from exc


def write_ids(ledger: str, writer_id: str, index: int, ids: Iterable[PunchedId]) -> None:
    """Durably replace the ids file of ledger segment ``(writer_id, index)`` (every id, old and new)."""
    write_state(ledger, _name(writer_id, index), encode(ids))


def ids_files(ledger: str) -> list[tuple[str, Seg]]:
    """The ids files of ``ledger`` (name, segment), sorted by name."""
    suffix = IDS_SUFFIX + STATE_SUFFIX
    try:
        names = sorted(os.listdir(ledger))
    except FileNotFoundError:
        return []
    parsed = [(name, parse_segment_name(name[: -len(suffix)])) for name in names if name.endswith(suffix)]
    return [(name, seg) for name, seg in parsed if seg is not None]


def find_punched(
    ledger: str, job_ids: Iterable[str] | None = None, segments: Callable[[Seg], bool] | None = None
) -> Iterator[tuple[Seg, PunchedId]]:
    """The kept ids of every ledger segment (with that segment), or only those of ``job_ids``.

    ``segments``: which ledger segments' files to read (the others are not opened).
    Looking a few ids up (``cancel()``), a file that holds none of their bytes is not decoded.
    A damaged file raises :class:`StateFileCorrupt` (docs/reliability.md rule 12): skipped, its
    succeeded jobs would answer ``unknown`` (docs/journal.md).
    """
    wanted = None if job_ids is None else set(job_ids)
    needles = []
    for job_id in wanted or ():
        hexid = len(job_id) == 32 and set(job_id) <= _HEXDIGITS
        needles.append(bytes.fromhex(job_id) if hexid else job_id.encode())
    for name, seg in ids_files(ledger):
        if segments is not None and not segments(seg):
            continue
        payload = _read(ledger, name[: -len(STATE_SUFFIX)])
        if payload is None or (wanted is not None and not any(n in payload for n in needles)):
            continue
        try:
            ids = decode(payload)
        except ValueError as exc:
            raise StateFileCorrupt(os.path.join(ledger, name), f"{_DAMAGED}: {exc}") from exc
        for p in ids:
            if wanted is None or p.job_id in wanted:
                yield seg, p


def damaged_ids(ledger: str) -> list[tuple[Seg, StateFileCorrupt]]:
    """The ids files of ``ledger`` that do not read or decode, each with its ledger segment.

    For ``journal verify`` and ``journal repair`` (docs/journal.md): a damaged one stops the
    forwarder, ``cancel()``, ``trace`` and a lookup rebuild, so it is corruption to report.
    """
    out = []
    for _name, seg in ids_files(ledger):
        try:
            read_ids(ledger, *seg)
        except StateFileCorrupt as exc:
            out.append((seg, exc))
    return out


def remove_orphans(ledger: str, present: set[Seg]) -> int:
    """Remove the ids files whose ledger segment is not in ``present`` (deleted); how many."""
    removed = 0
    for name, seg in ids_files(ledger):
        if seg not in present:
            try:
                os.unlink(os.path.join(ledger, name))
            except FileNotFoundError:
                continue
            removed += 1
    return removed
