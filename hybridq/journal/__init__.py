"""The append-only journal: hybridq's source of truth. Bytes in, bytes out.

Format: ``docs/journal-format.md``. This package must not import redis, rq, click or the job
envelope (checked by import-linter).
"""

from hybridq import crashpoints  # kept importable from here (it was hybridq.journal.crashpoints)

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
