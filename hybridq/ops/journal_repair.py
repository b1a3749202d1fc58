"""``hybridq journal repair``: the journal's repair, with the forwarder kept out while it runs.

:func:`hybridq.journal.repair.repair` does the work and knows nothing of who reads a journal;
this module names the owner locks it must hold: the journal's forwarder lock, and for a ledger
or key store directory (written by its journal's forwarder) the parent journal's forwarder lock
too.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from hybridq.journal import OS_FILEOPS, FileOps
from hybridq.journal.ownerlock import hold_owner_locks
from hybridq.journal.paths import existing_journal_dir
from hybridq.journal.repair import (
    BACKUP_PREFIX,
    REPORT_NAME,
    ChainRepair,
    DropKind,
    DroppedRecord,
    RepairReport,
)
from hybridq.journal.repair import repair as repair_journal
from hybridq.ledger import saved_index
from hybridq.ledger.checkpoint import LOCK_NAME
from hybridq.ledger.store import KEYS_DIR, LEDGER_DIR
from hybridq.ops.ids_repair import repair_ids

__all__ = [
    "BACKUP_PREFIX",
    "FORWARDER_LOCK_NAME",
    "REPORT_NAME",
    "ChainRepair",
    "DropKind",
    "DroppedRecord",
    "RepairReport",
    "repair",
]

#: The lock file a repair holds (``hybridq.forwarder.loop.LOCK_NAME``).
FORWARDER_LOCK_NAME = LOCK_NAME


def repair(
    path: str | os.PathLike[str],
    *,
    accept_loss: bool,
    progress: Callable[[int], None] | None = None,
    fileops: FileOps = OS_FILEOPS,
) -> RepairReport:
    """:func:`hybridq.journal.repair.repair` holding the forwarder lock(s) of ``path``.

    Args:
        path: the journal directory, or the ledger directory inside one (whose damaged ids
            files are reported, and moved into the backup: :mod:`hybridq.ops.ids_repair`).
        accept_loss: make the changes (``False``: a dry run).
        progress: called with the number of bytes just scanned.
        fileops: the file-operations seam.

    Raises:
        JournalLocked: a forwarder holds the journal (or the ledger's journal), or a damaged
            chain's writer is live.
        JournalPathError: the path is not a usable journal directory.
        JournalIOError: a file operation failed (see :func:`hybridq.journal.repair.repair`).
    """
    directory = existing_journal_dir(path)
    locks = [os.path.join(directory, LOCK_NAME)]
    if os.path.basename(directory) in (LEDGER_DIR, KEYS_DIR):
        locks.append(os.path.join(os.path.dirname(directory), LOCK_NAME))
    if accept_loss and os.path.basename(directory) == LEDGER_DIR:
        # The saved index may count records the repair drops: the next start replays them all.
        # Before the repair, so that one cut short by a crash leaves none either.
        saved_index.forget(os.path.dirname(directory), fileops)
    busy = "stop the forwarder before repairing"
    report = repair_journal(
        directory,
        accept_loss=accept_loss,
        progress=progress,
        fileops=fileops,
        owner_locks=locks,
        busy=busy,
    )
    if os.path.basename(directory) == LEDGER_DIR:
        # Its damaged ids files, after the chains (whose repair may have moved their segments).
        with hold_owner_locks(locks, owner="journal repair", busy=busy, create=accept_loss, fileops=fileops):
            repair_ids(fileops, directory, report)
    return report
