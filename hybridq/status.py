"""What ``hybridq status`` reports, computed from the journal, the ledger and the checkpoint.

Redis is optional: every contract field comes from durable state on this host, so the answer is
the same whether Redis is up, down or freshly emptied.
"""

from __future__ import annotations

import fcntl
import os
from typing import Any

from hybridq.forwarder import LOCK_NAME
from hybridq.journal import JournalReader
from hybridq.journal.compact import sealed_data_count
from hybridq.journal.paths import existing_journal_dir
from hybridq.journal.reader import list_chains, segment_usage
from hybridq.ledger import Compacted, consistent, load_index
from hybridq.state import load_checkpoint

__all__ = ["CONTRACT_FIELDS", "collect_status", "redact_url"]

#: The fields DESIGN.md promises in ``status --json`` (integers).
CONTRACT_FIELDS = ("accepted", "forwarded", "succeeded", "failed", "pending", "duplicates_suppressed")


def collect_status(journal: str, *, redis_url: str | None = None) -> dict[str, Any]:
    """The status object of ``hybridq status --json``."""
    path = existing_journal_dir(journal)
    out = consistent(path, lambda compacted: _counts(path, compacted))
    out["forwarder"] = _forwarder_holder(path)
    segments, size = segment_usage(path)
    out["journal"] = {"path": path, "segments": segments, "bytes": size}
    if redis_url is not None:
        out["redis"] = {"url": redact_url(redis_url), "up": _redis_up(redis_url)}
    return out


def _counts(path: str, compacted: Compacted) -> dict[str, Any]:
    """Every count of the status object, from the journal, the ledger and the checkpoint."""
    live = [
        (writer_id, index)
        for writer_id, indices in list_chains(path).items()
        for index in indices
        if not compacted.is_compacted((writer_id, index))
    ]
    # Segments whose deletion a crash interrupted are counted in `compacted` already.
    leftover = sum(
        sealed_data_count(path, w, i) or 0
        for w, indices in list_chains(path).items()
        for i in indices
        if compacted.is_compacted((w, i))
    )
    accepted = compacted.accepted + JournalReader(path).check() - leftover
    checkpoint = load_checkpoint(path)
    waiting = accepted - compacted.accepted
    if checkpoint is not None:
        waiting = JournalReader(path).check(checkpoint.positions)
    index = load_index(path, compacted)
    counts = index.counts(live)
    succeeded = compacted.succeeded + counts["succeeded"]
    # Records that are not jobs are terminal too (skipped, logged): they count as failed.
    failed = compacted.failed + counts["failed"] + compacted.invalid + counts["invalid"]
    suppressed = compacted.dups + counts["dups"]
    return {
        "accepted": accepted,
        "forwarded": checkpoint.forwarded if checkpoint else 0,
        "succeeded": succeeded,
        "failed": failed,
        "pending": accepted - succeeded - failed,
        "duplicates_suppressed": suppressed,
        "not_yet_forwarded": waiting,
        "delayed_held": len(checkpoint.held) if checkpoint else 0,
        "duplicate_pushes": checkpoint.duplicate_pushes if checkpoint else 0,
        "invalid_records": checkpoint.invalid if checkpoint else 0,
        "retrying": len(index.retries),
        "failed_listed": len(index.failed),
        "compacted_segments": sum(i + 1 for i in compacted.through.values()),
    }


def _forwarder_holder(path: str) -> str | None:
    """Who holds the forwarder lock, or ``None`` when no forwarder runs."""
    lock = os.path.join(path, LOCK_NAME)
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _redis_up(url: str) -> bool:
    from hybridq.errors import TransportError  # noqa: PLC0415
    from hybridq.transport.rq import RQTransport  # noqa: PLC0415 - only when Redis is asked for

    transport = RQTransport(url, socket_timeout_s=1.0)
    try:
        transport.ping()
    except TransportError:
        return False
    finally:
        transport.close()
    return True


def redact_url(url: str) -> str:
    """``url`` with any password (``user:pass@`` or ``?password=``) replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest, qsep, query = rest.partition("?")
    if "@" in rest:
        creds, _, host = rest.rpartition("@")
        user = creds.split(":", 1)[0]
        rest = f"{user}:***@{host}" if user else f"***@{host}"
    if qsep:
        params = [
            f"{key}=***" if key.lower() == "password" else f"{key}{eq}{value}"
            for key, eq, value in (part.partition("=") for part in query.split("&"))
        ]
        rest = rest + "?" + "&".join(params)
    return f"{scheme}://{rest}"
