"""The ledger's index saved to a file, so a start replays only the ledger records written after it.

Replaying the whole ledger at start is O(finished jobs of the live journal segments): 200,000
``done`` entries took 2 to 4 s before the forwarder's first push (issue 29). The forwarder saves
its :class:`LedgerIndex` at a clean stop and every so many entries (``ledger-index.state`` in the
journal directory, an atomic, checksummed state file: docs/reliability.md rule 6) together with
what it covers: per ledger chain, the position up to which every record is folded in, and the
compaction state it was made under. A start loads it, then replays only what follows those
positions (:func:`hybridq.ledger.store.replay`).

A saved index is only a cache of the ledger, and trusted only where it provably still is one.
It is ignored (the whole ledger replayed, as without it) when it is damaged, of another version,
names a ledger chain that is gone (saves name only chains that exist), a position past the end
of its chain or a segment the chain never had, or was made under compaction of a journal segment
that is live now; a ledger chain it names that compaction
shortened is replayed from its first segment left, one it does not name from its start, and what
it says of journal segments compacted since it was saved is dropped as the replay drops it. The
reader checks each chain's first record after the position (its sequence number and checksum): a
ledger changed under it raises, and the whole ledger is replayed. ``hybridq journal repair`` of
the ledger deletes the file (:func:`forget`). The file's format is :mod:`hybridq.ledger.saved_codec`'s.

This module must not import redis or rq.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping

from hybridq import crashpoints
from hybridq.errors import JournalCorruption, JournalIOError
from hybridq.journal import OS_FILEOPS, ChainPosition, FileOps, Record
from hybridq.journal.format import FILE_HEADER_SIZE, SEAL_RECORDS, segment_name
from hybridq.journal.reader import list_chains, read_seal
from hybridq.journal.statefile import StatePayload, open_state, write_state_pieces
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.keytable import KeyTable
from hybridq.ledger.saved_codec import Saved, decode, decode_lines, encode, encode_pieces, lines_of
from hybridq.ledger.store import gone, ledger_dir, replay

__all__ = [
    "SAVED_INDEX_NAME",
    "SAVE_EVERY",
    "IndexSaver",
    "Saved",
    "decode",
    "encode",
    "forget",
    "load",
    "resume",
    "save",
]

log = logging.getLogger("hybridq.ledger")

#: The state file (``<journal>/ledger-index.state``).
SAVED_INDEX_NAME = "ledger-index"
#: The forwarder saves its index at least every this many appended entries (:class:`IndexSaver`).
SAVE_EVERY = 20_000


def save(
    journal: str, index: LedgerIndex, covered: Mapping[str, ChainPosition], through: Mapping[str, int]
) -> dict[str, ChainPosition]:
    """Durably replace the saved index (a crash midway leaves the previous one whole).

    Returns what it covers: ``covered`` less the chains compacted away (a save names only
    chains that exist, with their first segment now).
    """
    ops = _CrashingOps() if crashpoints.enabled() else OS_FILEOPS
    path = ledger_dir(journal)
    chains = list_chains(path) if os.path.isdir(path) else {}
    kept = {writer: at for writer, at in covered.items() if writer in chains}
    first = {writer: chains[writer][0] for writer in kept}
    # Durable before the file that vouches for it, with the positions it covers (_fits at start).
    covers = json.dumps({"covered": {w: p.to_json() for w, p in kept.items()}, "first": first})
    keys_table = index.keys.mark(covers)
    crashpoints.reached("index_keys_marked")
    # In pieces, one segment's at a time (a spilled one read back alone): never the whole index's.
    pieces = encode_pieces(index, kept, through, first, keys_table)
    write_state_pieces(journal, SAVED_INDEX_NAME, pieces, fileops=ops)
    crashpoints.reached("index_after_save")
    return kept


class _CrashingOps(FileOps):
    """Writes half of what it is asked, then passes the ``index_mid_write`` crash point (tests)."""

    def write(self, fd: int, data: bytes | memoryview) -> int:
        written = super().write(fd, data[: max(1, len(data) // 2)])
        crashpoints.reached("index_mid_write")
        return written


def forget(journal: str, fileops: FileOps = OS_FILEOPS) -> None:
    """Durably delete the saved index (its ledger was changed by other means than appends: a repair).

    The journal directory is fsynced even if the file is gone: an unlink a kill left unsynced
    could come back (docs/reliability.md rule 5).
    """
    path, op = os.path.join(journal, SAVED_INDEX_NAME + ".state"), "unlink"
    try:
        with contextlib.suppress(FileNotFoundError):
            fileops.unlink(path)
        op = "directory fsync"
        fileops.fsync_dir(journal)
    except OSError as exc:
        raise JournalIOError(path, op, exc) from exc


def load(journal: str, keys: KeyTable | None = None, cap: int | None = None) -> Saved | None:
    """The saved index, ``None`` if there is none or it cannot be read (logged: a full replay).

    ``keys``: the key table its index gets (see :func:`decode`). ``cap``: the most listed
    offsets its index holds in memory (spilled to the journal's directory past it, as read:
    :func:`~hybridq.ledger.saved_codec.decode_lines`); the whole file's checksum is checked
    before any of it is read, and again over the bytes parsed (a difference: ignored, a full replay).
    """
    try:
        state = open_state(journal, SAVED_INDEX_NAME)
        if state is None:
            return None
        with state:
            return _decode_whole(state, keys, journal, cap)
    except Exception as exc:
        log.warning("ignoring the saved ledger index of %s (the whole ledger is replayed): %s", journal, exc)
        return None


def _decode_whole(state: StatePayload, keys: KeyTable | None, journal: str, cap: int | None) -> Saved:
    """The saved index in ``state``, read to its end.

    Its last chunk checks that the bytes parsed are the ones whose checksum was checked
    (:meth:`StatePayload.chunks` raises if not).
    """
    lines = lines_of(state.chunks())
    saved = decode_lines(lines, keys, journal, cap)
    if any(lines):  # one line (versions 2 to 5): decode_lines stops before the end
        raise ValueError("lines after the saved index")
    return saved


def resume(
    journal: str, compacted: Compacted, keys: KeyTable, cap: int | None = None
) -> tuple[LedgerIndex, dict[str, ChainPosition], int]:
    """The ledger's index (what :func:`~hybridq.ledger.store.load_index` gives), from the saved one.

    ``keys``: the key table the index gets (the forwarder passes the journal's,
    :meth:`KeyTable.in_journal`; a full replay empties it, so no other reader may pass that
    one while a forwarder runs); the saved index is used only if the table holds every key
    owner it covers (:meth:`KeyTable.trusts`), else the table is emptied and the whole ledger
    replayed into it. Returns the index, where each ledger chain ended as read, and how many
    chains were replayed from a saved position (0: none was usable, the whole ledger was
    replayed). ``cap``: the most listed offsets the index holds in memory, from the load and
    through the replay on (:meth:`LedgerIndex.spill_past`, files in ``journal``).
    """
    saved = load(journal, keys, cap)
    if saved is not None and not keys.trusts(*saved.keys_table):
        log.warning("ignoring the saved ledger index: the key table is not the one it was saved with")
        saved = None
    elif saved is not None and not _table_fits(journal, keys.covers):
        log.warning("ignoring the saved ledger index: the key table is ahead of the ledger (restored?)")
        saved = None
    since = None if saved is None else _usable(journal, saved, compacted)
    if saved is not None and since is not None:
        _compacted_since(saved.index, compacted, list_chains(journal))
        try:
            return saved.index, replay(journal, saved.index, compacted, since), len(since)
        except JournalCorruption as exc:
            log.warning("the ledger changed under its saved index (the whole ledger is replayed): %s", exc)
    keys.clear()
    index = LedgerIndex(keys=keys)
    index.spill_past(journal, cap)  # checked during the replay (store.replay)
    with keys.bulk():
        return index, replay(journal, index, compacted), 0


def _compacted_since(index: LedgerIndex, compacted: Compacted, chains: Mapping[str, list[int]]) -> None:
    """Drop from ``index`` what the replay keeps of no journal segment compacted since it was saved.

    The replay keeps, of a compacted segment, only failures still listed, requeue marks and keys.
    """
    first = {writer: indices[0] for writer, indices in chains.items()}
    for seg in [
        seg for seg in {*index.terminal, *index.dups, *index.dup_events} if gone(compacted, first, seg)
    ]:
        index.forget_segment(seg)
    index.duplicates.drop_segments(lambda seg: gone(compacted, first, seg))
    for table in (index.retries, index.lost, index.later, index.cancels):
        for loc in [loc for loc in table if gone(compacted, first, (loc[0], loc[1]))]:
            del table[loc]


def _usable(journal: str, saved: Saved, compacted: Compacted) -> dict[str, ChainPosition] | None:
    """Where to resume each ledger chain from ``saved``; ``None`` if it must not be trusted."""
    chains = list_chains(journal)
    for writer, through in saved.through.items():
        indices = chains.get(writer)
        if compacted.through.get(writer, -1) < through and indices is not None and indices[0] <= through:
            log.warning("ignoring the saved ledger index: it was made under compaction of a live segment")
            return None
    return _fits(journal, saved.covered, saved.first)


def _table_fits(journal: str, covers: str) -> bool:
    """Whether the ledger still holds what the key table's last mark covered (not restored older)."""
    try:
        body = json.loads(covers)
        covered = {str(w): ChainPosition.from_json(p) for w, p in body["covered"].items()}
        first = {str(w): int(i) for w, i in body["first"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return False
    return _fits(journal, covered, first) is not None


def _fits(
    journal: str, covered: Mapping[str, ChainPosition], first: Mapping[str, int]
) -> dict[str, ChainPosition] | None:
    """``covered`` if every position is in the ledger as it is, its chains' first segments ``first``."""
    path = ledger_dir(journal)
    ledger = list_chains(path) if os.path.isdir(path) else {}
    since: dict[str, ChainPosition] = {}
    for writer, at in covered.items():
        indices = ledger.get(writer)
        if indices is None:
            # Saves name only chains that exist: deleted since (by a compaction after the last
            # save, or by hand), and what it said of it cannot be told apart from the rest.
            log.warning("ignoring the saved ledger index: ledger chain %s is gone", writer)
            return None
        if indices[0] != first.get(writer):
            # Segments deleted since (ledger compaction): a key they held went to the key store
            # with its window, and may since have expired there; the index would bring it back
            # without one. The forwarder saves right after such a compaction (IndexSaver.soon).
            log.warning("ignoring the saved ledger index: ledger chain %s was compacted since", writer)
            return None
        # A segment a repair cut and sealed again (docs/operations.md, journal repair) ends
        # earlier, with a seal of lower seq: a position past its old end, in it or after it, is
        # refused (a saved index a power cut brought back after the repair's forget).
        if at.segment in indices:
            seal = _seal(path, writer, at.segment)
            fits = at.offset <= os.path.getsize(os.path.join(path, segment_name(writer, at.segment)))
            fits = fits and (seal is None or at.next_seq <= seal.seq)
        else:  # read to the end of its sealed last segment, or not a position of this chain
            fits = at.segment == indices[-1] + 1 and at.offset == FILE_HEADER_SIZE
            seal = _seal(path, writer, indices[-1]) if fits else None
            fits = seal is not None and at.next_seq == seal.seq + SEAL_RECORDS
        if not fits:
            log.warning(
                "ignoring the saved ledger index: ledger chain %s does not reach its position", writer
            )
            return None
        since[writer] = at
    return since


def _seal(path: str, writer: str, segment: int) -> Record | None:
    """The ledger segment's seal; ``None`` if it has none (a segment cut short since has none)."""
    try:
        return read_seal(path, writer, segment)
    except JournalCorruption:
        return None


class IndexSaver:
    """When the forwarder saves its index, and what it covers (it alone writes the file).

    It covers the ledger chains as the start read them (records other processes append later are
    replayed at the next start) and the forwarder's own chain up to its last append whose entries
    are folded in. Saved every :data:`SAVE_EVERY` entries, or a eighth of the index if more (each
    save costs O(index): amortized O(1) per entry), and at a clean stop; after a kill -9 a start
    replays at most that many entries past it.
    """

    def __init__(self, journal: str, read: Mapping[str, ChainPosition]) -> None:
        self.journal = journal
        self.covered = dict(read)
        self.unsaved = 0
        self._soon = False
        #: Appends begun and not folded in: after one that failed, nothing more is saved this run.
        self._open = 0

    @property
    def broken(self) -> bool:
        """Whether an append failed before its entries were folded in (its records may be durable)."""
        return self._open > 0

    def begin(self) -> None:
        """An append to the forwarder's own chain starts."""
        self._open += 1

    def appended(self, writer_id: str, end: ChainPosition, entries: int) -> None:
        """The append begun last is folded in: the own chain ends at ``end``, all of it in the index."""
        self._open -= 1
        self.covered[writer_id] = end
        self.unsaved += entries

    def savable(self, index: LedgerIndex) -> bool:
        """Whether a save may still succeed this run: not after a failed append or a poisoned key table."""
        return not self.broken and not index.keys.failed

    def due(self, index: LedgerIndex) -> bool:
        """Whether enough entries were appended since the last save, or :meth:`soon` was called."""
        return self.savable(index) and (
            self._soon or self.unsaved >= max(SAVE_EVERY, index.terminal_count // 8)
        )

    def soon(self) -> None:
        """Save at the next chance: ledger segments were deleted (the saved index no longer fits)."""
        self._soon = True

    def save(self, index: LedgerIndex, compacted: Compacted) -> bool:
        """Save ``index`` (a failure only leaves the previous one: a longer replay, logged).

        Returns whether it was saved (the ledger puncher punches nothing otherwise).
        """
        if not self.savable(index):  # a poisoned key table: the next start replays
            return False
        try:
            self.covered = save(self.journal, index, self.covered, compacted.through)
        except (OSError, ValueError, JournalIOError) as exc:  # ValueError: over a state file's size
            log.warning("cannot save the ledger index (the next start replays more of the ledger): %s", exc)
            return False
        self.unsaved, self._soon = 0, False
        return True
