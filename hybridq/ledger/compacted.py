"""The compaction state (:class:`Compacted`) and reads that stay right while compaction deletes.

Counters of compacted segments live in ``compaction.state`` (:class:`Compacted`), written before
any segment is deleted, so ``status`` totals survive compaction. :func:`consistent` reads again
when a compaction got in a read's way; :class:`AcceptedCounter` counts every job ever accepted,
compacted ones included.

This module must not import redis or rq.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from hybridq.errors import JournalCorruption, StateFileCorrupt
from hybridq.journal import ChainPosition, JournalReader
from hybridq.journal.statefile import read_state, write_state
from hybridq.ledger.entries import Seg

#: The state file holding the counters of compacted segments.
COMPACTION_NAME = "compaction"
T = TypeVar("T")


@dataclass
class Compacted:
    """Totals of compacted journal segments, and how far each chain has been compacted."""

    #: Per writer id, the highest segment index deleted (all lower ones are gone too).
    through: dict[str, int] = field(default_factory=dict)
    accepted: int = 0
    succeeded: int = 0
    failed: int = 0
    invalid: int = 0
    dups: int = 0
    cancelled: int = 0

    @property
    def terminal(self) -> int:
        """Jobs of compacted segments that were terminal (all of them: only those are deleted)."""
        return self.succeeded + self.failed + self.invalid + self.cancelled

    def is_compacted(self, seg: Seg) -> bool:
        """Whether journal segment ``seg`` is (being) deleted."""
        through = self.through.get(seg[0])
        return through is not None and seg[1] <= through

    def to_bytes(self) -> bytes:
        """JSON."""
        body = {
            "v": 1,
            "through": self.through,
            "accepted": self.accepted,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "invalid": self.invalid,
            "dups": self.dups,
        }
        if self.cancelled:  # left out while 0: an older version reads the state unchanged
            body["cancelled"] = self.cancelled
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, path: str) -> Compacted:
        """Decode; a malformed body raises :class:`StateFileCorrupt`."""
        try:
            body = json.loads(raw)
            return cls(
                through={str(w): int(i) for w, i in body["through"].items()},
                **{name: int(body[name]) for name in ("accepted", "succeeded", "failed", "invalid", "dups")},
                cancelled=int(body.get("cancelled", 0)),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StateFileCorrupt(path, f"malformed compaction state: {exc!r}") from exc


def consistent(journal: str, read: Callable[[Compacted], T], *, tries: int = 5) -> T:
    """``read(compaction state)``, again if a compaction ran meanwhile and got in its way.

    Readers list a directory, then open the files: the forwarder may delete one in between (a
    ``FileNotFoundError``, or a chain's head reading as missing), and totals read before and
    after a deletion do not add up. The answer is kept only if the compaction state did not
    change while it was computed.
    """
    for attempt in range(tries):
        before = load_compacted(journal)
        try:
            value = read(before)
        except (FileNotFoundError, JournalCorruption):
            if attempt == tries - 1 or (load_compacted(journal) == before and not _vanished()):
                raise
            continue
        if load_compacted(journal) == before or attempt == tries - 1:
            return value
    raise AssertionError("unreachable")  # pragma: no cover


def _vanished() -> bool:
    """Whether the exception being handled is a file that vanished (only deletion does that)."""
    return isinstance(sys.exc_info()[1], FileNotFoundError)


class AcceptedCounter:
    """Every job ever accepted into a journal (compacted ones included), counted incrementally.

    Each :meth:`count` reads only the records added since the last one. When compaction deleted
    the segment the reader stood in (it reads as a missing segment), it counts afresh: the
    journal first, then the compaction state, so a compaction in between counts a segment
    twice (the safe side for a capacity check), never not at all. Not thread-safe.

    Args:
        journal: the journal directory.
        since: for a reader that already counted part of the journal (the forwarder): returns how
            many jobs lie before which positions, and counting afresh reads only what follows.
    """

    def __init__(
        self, journal: str, since: Callable[[], tuple[int, Mapping[str, ChainPosition]]] | None = None
    ) -> None:
        self.journal = journal
        self.since = since
        self._reader: JournalReader | None = None
        self._accepted = 0

    def count(self) -> int:
        """The number of jobs accepted so far; real corruption raises."""
        if self._reader is not None:
            try:
                self._accepted += self._reader.check()
            except (JournalCorruption, FileNotFoundError):
                self._reader = None  # compacted under it: count afresh (real damage raises below)
        if self._reader is None:
            self._reader = JournalReader(self.journal)
            if self.since is not None:
                before, positions = self.since()
                self._accepted = before + self._reader.check(positions)
            else:
                live = self._reader.check()
                self._accepted = live + load_compacted(self.journal).accepted
        return self._accepted


def load_compacted(journal: str) -> Compacted:
    """The compaction state (empty if nothing was ever compacted)."""
    raw = read_state(journal, COMPACTION_NAME)
    if raw is None:
        return Compacted()
    return Compacted.from_bytes(raw, os.path.join(journal, f"{COMPACTION_NAME}.state"))


def save_compacted(journal: str, compacted: Compacted) -> None:
    """Durably replace the compaction state."""
    write_state(journal, COMPACTION_NAME, compacted.to_bytes())
