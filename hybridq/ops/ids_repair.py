"""``hybridq journal repair`` of a ledger directory's damaged ids files: reported, then moved aside.

A damaged ids file stops the forwarder, ``cancel()``, ``trace`` and a lookup rebuild
(docs/reliability.md rule 12). Dropping it is safe (docs/journal.md, "Entries punched out of
pinned ledger segments"): it only names finished jobs whose journal records are punched, so a
start still counts them finished from the journal's hole maps and their keys stay in the key
store; they answer as compacted ones (``cancel()`` unknown, no lookup row after a rebuild, a
``depends_on`` child fails after ``UNKNOWN_DEP_S``) and none runs again. So a repair with
``accept_loss`` moves each damaged one into the repair's backup, durably, and reports it as a
:attr:`~hybridq.journal.repair_report.DropKind.IDS` entry.
"""

from __future__ import annotations

import json
import os

from hybridq.errors import JournalCorruption, JournalIOError
from hybridq.journal import FileOps
from hybridq.journal.fileops import replace_durably, write_all
from hybridq.journal.format import segment_name
from hybridq.journal.repair_apply import REPORT_NAME, make_backup_dir, write_report
from hybridq.journal.repair_report import ChainRepair, DropKind, DroppedRecord, RepairReport
from hybridq.journal.statefile import STATE_SUFFIX
from hybridq.ledger.punched_ids import IDS_SUFFIX, damaged_ids
from hybridq.ledger.store import LEDGER_DIR

__all__ = ["check_ids", "repair_ids"]

#: What the report says of a damaged ids file.
REASON = (
    "damaged ids file: its finished jobs answer as compacted ones (cancel() unknown, no lookup row "
    "after a rebuild, a depends_on child fails); none runs again"
)


def check_ids(journal: str) -> None:
    """``journal verify``: raise :class:`JournalCorruption` for the first damaged ids file.

    ``journal``: a journal directory (its ``ledger/`` is checked) or a ledger directory.
    """
    for directory in (journal, os.path.join(journal, LEDGER_DIR)):
        for _seg, exc in damaged_ids(directory):
            # No journal record is lost: the jobs it names are finished (first_seq > last_seq says so).
            raise JournalCorruption(exc.path, 0, f"damaged ids file: {exc.reason}", first_seq=1, last_seq=0)


def _summary(path: str, seg: tuple[str, int]) -> ChainRepair:
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        size = 0
    drop = DroppedRecord(seg[0], seg[1], 0, size, DropKind.IDS, None, None)
    return ChainRepair(seg[0], path, 0, REASON, (), (path,), (drop,), size, None)


def repair_ids(ops: FileOps, directory: str, report: RepairReport) -> None:
    """Report the damaged ids files of ledger directory ``directory``; with ``accept_loss``, move them aside.

    The caller holds the forwarder locks. Each file goes into the report's backup (made here when
    the chains needed none), after ``repair-report.json`` says so, by a rename and the fsync of
    both directories (docs/reliability.md rules 5 and 6).
    """
    found = []
    for seg, _exc in damaged_ids(directory):
        found.append(_summary(os.path.join(directory, segment_name(*seg) + IDS_SUFFIX + STATE_SUFFIX), seg))
    if not found:
        return
    report.repairs.extend(found)
    if not report.accept_loss:
        return
    if report.backup is None:
        report.backup = make_backup_dir(ops, directory)
        write_report(ops, report.backup, report)
    else:  # the chains' repair wrote it without these
        path = os.path.join(report.backup, REPORT_NAME)
        data = json.dumps(report.to_dict(), indent=1).encode() + b"\n"
        replace_durably(ops, path, lambda fd: write_all(ops, fd, data), tmp=path + ".new")
    for repair in found:
        dest = os.path.join(report.backup, os.path.basename(repair.path))
        op = "rename"
        try:
            ops.replace(repair.path, dest)
            op = "directory fsync"
            ops.fsync_dir(report.backup)
            ops.fsync_dir(directory)
        except OSError as exc:
            raise JournalIOError(repair.path, op, exc) from exc
        report.applied = True
