"""The append-only journal: hybridq's source of truth. Bytes in, bytes out.

It owns the segment files and their record framing (``format``, ``records``), the group commit
that acknowledges only after an fsync (``writer``, ``commit``, ``segment``), streaming reads and
the torn-tail policy (``reader``, ``scan``, ``recovery``), one record read back by its location
and a segment's seal (``random_access``), atomic state files (``statefile``),
the directory's checks and owner locks (``paths``, ``ownerlock``), and repair (``repair*``). It
may use only the standard library, the CRC library, :mod:`hybridq.errors` and
:mod:`hybridq.crashpoints`: it must not import redis, rq, click or the job envelope (checked by
import-linter), and it names nothing of the layers above it: what the bytes mean, and who else
locks a directory, are its callers' business. Format: ``docs/journal-format.md``.

The names below load on first use (PEP 562): importing one module of the package
(``hybridq.journal.paths`` for a command's default, in ``hybridq worker``) does not load the
reader, the writer and the CRC library (whose import alone costs ~25 ms).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridq import crashpoints  # kept importable from here (it was hybridq.journal.crashpoints)
from hybridq.lazy import lazy_names

if TYPE_CHECKING:
    from .fileops import OS_FILEOPS, FileOps
    from .format import MAX_PAYLOAD_BYTES, RecordType
    from .reader import ChainPosition, JournalReader, Record, TornTail
    from .writer import Durability, JournalWriter, RecordId

__all__ = [
    "MAX_PAYLOAD_BYTES",
    "OS_FILEOPS",
    "ChainPosition",
    "Durability",
    "FileOps",
    "JournalReader",
    "JournalWriter",
    "Record",
    "RecordId",
    "RecordType",
    "TornTail",
    "crashpoints",
]

_LAZY = {
    "MAX_PAYLOAD_BYTES": ".format",
    "OS_FILEOPS": ".fileops",
    "ChainPosition": ".reader",
    "Durability": ".writer",
    "FileOps": ".fileops",
    "JournalReader": ".reader",
    "JournalWriter": ".writer",
    "Record": ".reader",
    "RecordId": ".writer",
    "RecordType": ".format",
    "TornTail": ".reader",
}

__getattr__, __dir__ = lazy_names(globals(), _LAZY)
