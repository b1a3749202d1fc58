"""The append-only journal: hybridq's source of truth. Bytes in, bytes out.

Format: ``docs/journal-format.md``. This package must not import redis, rq, click or the job
envelope (checked by import-linter).

The names below load on first use (PEP 562): importing one module of the package
(``hybridq.journal.paths`` for a command's default, in ``hybridq worker``) does not load the
reader, the writer and the CRC library (whose import alone costs ~25 ms).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridq import crashpoints

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

# Where each name lives (crashpoints is kept importable from here: it was hybridq.journal.crashpoints).
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


def __getattr__(name: str) -> Any:
    if name == "crashpoints":
        value: Any = importlib.import_module("hybridq.crashpoints")
    else:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
