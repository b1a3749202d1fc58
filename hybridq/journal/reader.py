"""Streaming reads of a journal directory, with the torn-tail / corruption policy of the format.

Format and policy: ``docs/journal-format.md`` (*Torn tail and corruption*). Memory is bounded by
one read chunk plus one record, however large the journal. This module never writes; repairing a
torn tail is :mod:`hybridq.journal.recovery`'s job. Reads of one record by its location, and of
a segment's seal, are :mod:`hybridq.journal.random_access`'s (re-exported here).

This module must not import redis, rq, click or the job envelope.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Generator, Iterator, Mapping

from hybridq.errors import JournalCorruption, JournalPathError

from .fileops import OS_FILEOPS, FileOps
from .format import FILE_HEADER_SIZE, parse_segment_name, segment_name
from .paths import existing_journal_dir
from .random_access import SegmentFile, clamp_to_seals, peek_header, read_record_at, read_seal, seal_offset
from .records import ChainPosition, Record, SegmentInfo, TornTail
from .scan import SegmentScan

__all__ = [
    "ChainPosition",
    "JournalReader",
    "Record",
    "SegmentFile",
    "SegmentInfo",
    "TornTail",
    "clamp_to_seals",
    "journal_usage",
    "list_chains",
    "peek_header",
    "read_record_at",
    "read_seal",
    "seal_offset",
    "segment_usage",
]

_CHUNK_BYTES = 1 << 20


def list_chains(path: str) -> dict[str, list[int]]:
    """Segment indices of every chain in the journal directory, sorted."""
    chains: dict[str, list[int]] = {}
    try:
        names = os.listdir(path)
    except OSError as exc:
        raise JournalPathError(path, exc.strerror or str(exc)) from exc
    for name in names:
        parsed = parse_segment_name(name)
        if parsed is not None:
            chains.setdefault(parsed[0], []).append(parsed[1])
    for indices in chains.values():
        indices.sort()
    return dict(sorted(chains.items()))


def segment_usage(path: str) -> tuple[int, int]:
    """``(segment files, bytes)`` of a journal directory; ``(0, 0)`` when it cannot be listed."""
    segments, size, _ = journal_usage(path)
    return segments, size


def journal_usage(path: str) -> tuple[int, int, int]:
    """``(segment files, bytes, disk bytes)`` of a journal directory; zeros when it cannot be listed.

    ``bytes`` are the segments' sizes; ``disk bytes`` the blocks they hold (``st_blocks`` times
    512: each file rounded up to whole blocks), less than their sizes once finished records are
    punched out of pinned segments (docs/journal.md, "Finished records punched out of pinned
    segments").
    """
    segments = size = disk = 0
    try:
        entries = list(os.scandir(path))
    except OSError:
        return 0, 0, 0
    for entry in entries:
        if parse_segment_name(entry.name) is not None:
            segments += 1
            st = entry.stat(follow_symlinks=False)
            size += st.st_size
            disk += st.st_blocks * 512
    return segments, size, disk


class JournalReader:
    """Reads every chain of a journal directory from a position, record by record.

    Args:
        path: an existing journal directory.
        fileops: the file-operations seam.
        chunk_bytes: read size; memory use is about one chunk plus one record.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fileops: FileOps = OS_FILEOPS,
        chunk_bytes: int = _CHUNK_BYTES,
    ) -> None:
        self.path = existing_journal_dir(path)
        self._ops = fileops
        self._chunk = max(chunk_bytes, 4096)
        self._positions: dict[str, ChainPosition] = {}  # as of the end of a segment
        self._last: dict[str, Record] = {}  # last record yielded since, per chain
        #: Torn tails seen by the last scan (dead writers' last segments).
        self.torn_tails: list[TornTail] = []
        #: The last segment of each chain as of the last scan.
        self.chain_ends: dict[str, SegmentInfo] = {}
        #: Data records counted by the last :meth:`check`.
        self.records_checked = 0
        #: Per segment, the data records the last scan skipped in punched ranges (their jobs all
        #: finished, hybridq.journal.holes): a count of the records read must add them.
        self.records_punched: dict[tuple[str, int], int] = {}
        #: Called with the number of bytes just read, for progress bars.
        self.on_bytes: Callable[[int], None] | None = None

    def records(
        self,
        since: Mapping[str, ChainPosition] | None = None,
        until: Mapping[str, ChainPosition] | None = None,
    ) -> Iterator[Record]:
        """Yield every data record after a position, chain by chain.

        ``since`` replaces the reader's position; without it the scan continues from where the
        last one stopped (from the very start, the first time). Call again to tail the journal.
        ``until``: only the chains it names, each up to that position (what a reader standing
        there has read); the reader stops just after the last record yielded.
        Raises :class:`JournalCorruption` on damage; records before it have been yielded, the
        damaged one never is.
        """
        return self._scan(since, emit=True, until=until)

    def check(self, since: Mapping[str, ChainPosition] | None = None, *, tails_only: bool = False) -> int:
        """Like :meth:`records`, but only checks and counts them (the fast path of verify).

        ``tails_only``: read only each chain's last segment, and only if it is not sealed (its
        link to the one before is checked, and every index of the chain must be there): what
        start-up needs to find torn tails and dead chains in O(tail). The sealed segments are
        checked later (:meth:`check_segment`, ``BackgroundCheck``,
        docs/reliability.md).
        """
        self.records_checked = 0
        for _ in self._scan(since, emit=False, tails_only=tails_only):  # pragma: no cover - yields nothing
            pass
        return self.records_checked

    def segment_records(self, writer_id: str, index: int) -> Iterator[Record]:
        """The data records of one sealed segment, checked as a scan checks them.

        Raises :class:`JournalCorruption` on damage (an unsealed segment too).
        """
        prev_salt = self._previous_salt(writer_id, index - 1) if index > 0 else None
        yield from self._read_segment(
            writer_id, index, FILE_HEADER_SIZE, None, prev_salt, is_last=False, emit=True
        )

    def check_segment(self, writer_id: str, index: int) -> int:
        """Check one segment whole (its header's link to the previous one too); count its records.

        Raises :class:`JournalCorruption` on damage, :class:`FileNotFoundError` if it is gone.
        """
        return self.segment_info(writer_id, index).data_count

    def segment_info(self, writer_id: str, index: int) -> SegmentInfo:
        """What a whole check of one sealed segment finds (raises as :meth:`check_segment`)."""
        prev_salt = self._previous_salt(writer_id, index - 1) if index > 0 else None
        scan = self._read_segment(
            writer_id, index, FILE_HEADER_SIZE, None, prev_salt, is_last=False, emit=False
        )
        while True:
            try:
                next(scan)  # pragma: no cover - yields nothing (emit is off)
            except StopIteration as done:
                info: SegmentInfo = done.value
                return info

    def _scan(
        self,
        since: Mapping[str, ChainPosition] | None,
        *,
        emit: bool,
        tails_only: bool = False,
        until: Mapping[str, ChainPosition] | None = None,
    ) -> Iterator[Record]:
        self._positions = dict(since) if since is not None else self.position
        self._last = {}
        self.torn_tails = []
        self.chain_ends = {}
        self.records_punched = {}
        for writer_id, indices in list_chains(self.path).items():
            if until is None:
                yield from self._read_chain(writer_id, indices, emit, tails_only=tails_only)
            elif writer_id in until:
                yield from self._read_until(writer_id, indices, until[writer_id])

    def _read_until(self, writer_id: str, indices: list[int], stop: ChainPosition) -> Iterator[Record]:
        """A chain's records up to ``stop``: the rest of the chain is not read."""
        chain = self._read_chain(writer_id, indices, emit=True)
        try:
            for record in chain:
                if (record.segment_index, record.end) > (stop.segment, stop.offset):
                    self._last.pop(writer_id, None)  # not yielded: the position stays before it
                    return
                yield record
                self._positions[writer_id] = record.position
        finally:
            chain.close()

    def seek(self, positions: Mapping[str, ChainPosition]) -> None:
        """Make the next :meth:`records` start at ``positions`` (chains not named: at their start)."""
        self._positions = dict(positions)
        self._last = {}

    @property
    def position(self) -> dict[str, ChainPosition]:
        """Per chain, the position just after the last record yielded (or segment consumed)."""
        merged = dict(self._positions)
        for writer_id, rec in self._last.items():
            merged[writer_id] = rec.position
        return merged

    def _read_chain(
        self, writer_id: str, indices: list[int], emit: bool, *, tails_only: bool = False
    ) -> Generator[Record, None, None]:
        pos = self._positions.get(writer_id)
        start_index = pos.segment if pos is not None else indices[0]
        todo = [i for i in indices if i >= start_index]
        if pos is not None and todo and todo[0] != pos.segment:
            # The segment we were reading is gone while later ones exist: records are missing.
            missing = os.path.join(self.path, segment_name(writer_id, pos.segment))
            raise JournalCorruption(
                missing, 0, f"segment index {pos.segment} of the chain is missing", first_seq=pos.next_seq
            )
        if not todo:
            return
        for prev, cur in itertools.pairwise(todo):
            if cur != prev + 1:
                missing = os.path.join(self.path, segment_name(writer_id, prev + 1))
                raise JournalCorruption(missing, 0, f"segment index {prev + 1} of the chain is missing")
        if tails_only and pos is None:
            todo = todo[-1:]
            if seal_offset(self.path, writer_id, todo[0]) is not None:
                return  # sealed: nothing to repair, its records checked later like the others
        prev_salt: bytes | None = None
        expected_seq: int | None = None
        offset = FILE_HEADER_SIZE
        if pos is not None and pos.segment == todo[0]:
            offset, expected_seq = pos.offset, pos.next_seq
        if todo[0] > 0 and (pos is None or pos.segment != todo[0] or offset == FILE_HEADER_SIZE):
            prev_salt = self._previous_salt(writer_id, todo[0] - 1)
        for n, index in enumerate(todo):
            is_last = n == len(todo) - 1
            info = yield from self._read_segment(
                writer_id, index, offset, expected_seq, prev_salt, is_last, emit
            )
            self._last.pop(writer_id, None)
            self.records_checked += info.data_count
            if info.punched:
                self.records_punched[(writer_id, index)] = info.punched
            self._positions[writer_id] = ChainPosition(index, info.end_offset, info.next_seq)
            prev_salt, expected_seq, offset = info.salt, info.next_seq, FILE_HEADER_SIZE
            if is_last:
                self.chain_ends[writer_id] = info
                if info.torn is not None:
                    self.torn_tails.append(info.torn)
            if info.sealed:
                # Resume at the next segment's start once this one is fully consumed.
                self._positions[writer_id] = ChainPosition(index + 1, FILE_HEADER_SIZE, info.next_seq)

    def _previous_salt(self, writer_id: str, index: int) -> bytes | None:
        """Salt of an earlier segment if it is still there (it may have been compacted away)."""
        header = peek_header(os.path.join(self.path, segment_name(writer_id, index)), fileops=self._ops)
        return header.salt if header is not None else None  # a bad one is reported when read

    def _read_segment(
        self,
        writer_id: str,
        index: int,
        offset: int,
        expected_seq: int | None,
        prev_salt: bytes | None,
        is_last: bool,
        emit: bool,
    ) -> Generator[Record, None, SegmentInfo]:
        path = os.path.join(self.path, segment_name(writer_id, index))
        fd = self._ops.open(path, os.O_RDONLY)
        try:
            scan = SegmentScan(
                self._ops,
                fd,
                path,
                writer_id,
                index,
                is_last,
                emit,
                chunk=self._chunk,
                last=self._last,
                on_bytes=self.on_bytes,
            )
            header = scan.read_header(prev_salt, expected_seq if offset == FILE_HEADER_SIZE else None)
            info = SegmentInfo(path, writer_id, index, header.salt, header.first_seq)
            yield from scan.run(info, offset, expected_seq or header.first_seq)
            return info
        finally:
            self._ops.close(fd)
