"""Named crash points, armed only by the ``HYBRIDQ_CRASH_POINT`` environment variable.

Used by the crash tests (docs/reliability.md): the journal writer's points (S2), compaction's and
the forwarder's (S13), the outbox relay's (docs/outbox.md), the scheduler's (docs/schedules.md),
the workflows' (docs/workflows.md), the saved ledger index's (docs/forwarder.md).
``HYBRIDQ_CRASH_POINT=mid_record:3`` makes the process SIGKILL itself the third time the writer
reaches ``mid_record``. Unarmed, a crash point costs one attribute check.
"""

from __future__ import annotations

import os
import signal

__all__ = [
    "COMPACTION_NAMES",
    "FORWARDER_NAMES",
    "INDEX_NAMES",
    "LEDGER_PUNCH_NAMES",
    "NAMES",
    "PUNCH_NAMES",
    "RELAY_NAMES",
    "SCHEDULE_NAMES",
    "WORKFLOW_NAMES",
    "armed",
    "enabled",
    "reached",
]

#: The points the journal writer passes, in order, on every append.
NAMES = ("before_write", "mid_record", "after_write_before_fsync", "after_fsync_before_ack")
#: The points compaction passes, in order, for each segment it deletes (S13).
COMPACTION_NAMES = ("compact_after_state", "compact_after_unlink")
#: The points punching passes, in order, for each segment it punches (hybridq.journal.holes): the
#: sealed segment writable; its hole map written; its ranges punched, not yet fsync'd.
PUNCH_NAMES = ("punch_writable", "punch_after_map", "punch_after_punch")
#: The ledger punch's points (hybridq.forwarder.ledger_punch): a run's ``key`` entries in the key
#: store; the index saved; the ids of its successes kept (hybridq.ledger.punched_ids); the ledger
#: segment's hole map not yet written at any of them; then :data:`PUNCH_NAMES` on the ledger.
LEDGER_PUNCH_NAMES = ("ledger_punch_after_keys", "ledger_punch_after_index", "ledger_punch_after_ids")
#: The points the forwarder passes while harvesting completions.
FORWARDER_NAMES = ("harvest_after_ledger", "redeliver_after_ledger")
#: The outbox relay's point: its batch is in the journal, its rows not yet deleted.
RELAY_NAMES = ("relay_after_append",)
#: The scheduler's point: its ticks are in the journal, its record of them not yet saved.
SCHEDULE_NAMES = ("schedule_after_append",)
#: The workflows' points: released steps in the journal, not yet marked released; a workflow's
#: end in the ledger, its row not yet updated (docs/workflows.md).
WORKFLOW_NAMES = ("flows_after_release", "flows_after_end")
#: The saved ledger index's points: half of its file written; the file replaced; the key table
#: marked, the file not written yet; key owners applied, their transaction not committed (issue 29).
INDEX_NAMES = ("index_mid_write", "index_after_save", "index_keys_marked", "keys_before_commit")
_ALL = (
    NAMES
    + COMPACTION_NAMES
    + PUNCH_NAMES
    + LEDGER_PUNCH_NAMES
    + FORWARDER_NAMES
    + RELAY_NAMES
    + SCHEDULE_NAMES
    + WORKFLOW_NAMES
    + INDEX_NAMES
)

_spec: tuple[str, int] | None = None
_loaded = False
_count = 0


def _load() -> tuple[str, int] | None:
    global _spec, _loaded
    if not _loaded:
        raw = os.environ.get("HYBRIDQ_CRASH_POINT", "")
        if raw:
            name, _, nth = raw.partition(":")
            if name not in _ALL:
                raise ValueError(f"HYBRIDQ_CRASH_POINT: unknown point {name!r}; known: {_ALL}")
            _spec = (name, int(nth or "1"))
        _loaded = True
    return _spec


def enabled() -> bool:
    """Whether any crash point is armed in this process."""
    return _load() is not None


def armed(name: str) -> bool:
    """Whether the next :func:`reached` of ``name`` would kill the process."""
    spec = _load()
    return spec is not None and spec[0] == name and _count + 1 >= spec[1]


def reached(name: str) -> None:
    """Kill the process with SIGKILL if ``name`` is armed and this is its Nth passage."""
    global _count
    spec = _load()
    if spec is None or spec[0] != name:
        return
    _count += 1
    if _count >= spec[1]:
        os.kill(os.getpid(), signal.SIGKILL)
