"""Explicit, loss-accepting repair of mid-file corruption (``hybridq journal repair --accept-loss``).

Policy: ``docs/journal-format.md`` (*Torn tail and corruption*) and docs/reliability.md rule 11:
corruption is refused on open; this module is the one way past it, and only when asked. It
reports exactly what it drops (etcd's ``Repair``, ``redis-check-aof --fix``), keeps a backup of
every file it changes or removes, and never skips a damaged record silently (LevelDB).

What a repair does, per chain, at the **first** damage found by the same scan the reader uses:

* The damaged segment is cut at the end of its last valid data record and sealed afresh. The
  records before the damage stay exactly where they were (same offsets, same sequence numbers).
* Sequence numbers must stay contiguous across a chain (the reader refuses a gap between
  segments), so the chain's later segments can stay only when nothing with a sequence number
  was lost (damage confined to the seal, or bytes after it). Otherwise they are moved into the
  backup and reported as dropped, record by record.
* A segment whose header is bad (or does not follow on from the previous one) cannot be
  checked at all: it and every later segment of its chain are moved into the backup. So are
  the segments after a missing middle segment.

Torn tails are not corruption: :func:`~hybridq.journal.recovery.recover` repairs them and this
module leaves them alone. A dry run (``accept_loss=False``) reads only and reports the same
plan. The plan is :mod:`~hybridq.journal.repair_plan`'s, the changes
:mod:`~hybridq.journal.repair_apply`'s, the report :mod:`~hybridq.journal.repair_report`'s.

The journal's reader (its owner) must not read while a repair runs: the caller names the owner
lock files to hold (:mod:`~hybridq.journal.ownerlock`). This module must not import redis, rq,
click or the job envelope.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

from .fileops import OS_FILEOPS, FileOps
from .ownerlock import hold_owner_locks
from .paths import existing_journal_dir
from .reader import list_chains
from .repair_apply import (
    BACKUP_PREFIX,
    REPORT_NAME,
    apply_chain,
    check_not_live,
    make_backup_dir,
    write_report,
)
from .repair_plan import plan_chain, summarize
from .repair_report import ChainRepair, DropKind, DroppedRecord, RepairReport

__all__ = [
    "BACKUP_PREFIX",
    "REPORT_NAME",
    "ChainRepair",
    "DropKind",
    "DroppedRecord",
    "RepairReport",
    "repair",
]

log = logging.getLogger("hybridq.journal")


def repair(
    path: str | os.PathLike[str],
    *,
    accept_loss: bool,
    progress: Callable[[int], None] | None = None,
    fileops: FileOps = OS_FILEOPS,
    owner_locks: Sequence[str] = (),
    busy: str = "stop it before repairing",
) -> RepairReport:
    """Find mid-file corruption and, with ``accept_loss``, cut it out; report exactly what goes.

    Holds the owner locks ``owner_locks`` throughout (the journal's reader stays out while it
    runs) and never touches a segment a live writer holds. Without ``accept_loss`` it only
    reads: the report says what a repair would drop. With it, every file changed or removed is
    first copied or moved into ``<journal>/repair-backup-<timestamp>/`` (``repair-report.json``
    in it is written before the first change), and the journal is left so that
    :func:`~hybridq.journal.recovery.verify` accepts it. A journal without corruption is left
    as it is (torn tails are :func:`~hybridq.journal.recovery.recover`'s job).

    Args:
        path: the journal directory.
        accept_loss: make the changes (``False``: a dry run).
        progress: called with the number of bytes just scanned (for a progress bar over the
            total size of the segment files).
        fileops: the file-operations seam.
        owner_locks: the owner lock files to hold (:func:`~hybridq.journal.ownerlock.hold_owner_locks`);
            with ``accept_loss`` the first is created when missing and names the repair.
        busy: what a refusal says after the name of an owner lock's holder.

    Raises:
        JournalLocked: a process holds one of ``owner_locks``, or a damaged chain's writer is live (or
            changed the chain during the repair). Nothing was changed for that chain.
        JournalPathError: the path is not a usable journal directory.
        JournalIOError: a file operation failed; the journal is either repaired or still
            refused, and the backup holds every original already touched.
    """
    directory = existing_journal_dir(path)
    report = RepairReport(directory, accept_loss)
    with hold_owner_locks(
        owner_locks, owner="journal repair", busy=busy, create=accept_loss, fileops=fileops
    ):
        chains = list_chains(directory)
        report.chains = len(chains)
        plans = []
        for writer_id, indices in chains.items():
            plan = plan_chain(fileops, directory, writer_id, indices, report, progress)
            if plan.damage is not None:
                plans.append(plan)
        for plan in plans:
            check_not_live(fileops, directory, plan)
        report.repairs = [summarize(plan) for plan in plans]
        if not accept_loss or not plans:
            return report
        report.backup = make_backup_dir(fileops, directory)
        # Written first, so that the backup says what it holds even if the repair is cut short.
        write_report(fileops, report.backup, report)
        for plan, summary in zip(plans, report.repairs, strict=True):
            apply_chain(fileops, directory, report.backup, plan)
            report.applied = True
            log.warning(
                "journal repair: chain %s: %s at offset %d (%s): %d data records and %d bytes dropped; "
                "backup in %s",
                plan.writer_id,
                summary.path,
                summary.offset,
                summary.reason,
                summary.data_records_dropped,
                summary.bytes_dropped,
                report.backup,
            )
    return report
