"""The figures :func:`hybridq.stats` reads instead of scanning: kept by the forwarder, saved each step.

``hybridq status`` used to read the whole live journal and the whole ledger on every call. The
forwarder already holds most of its figures in memory (the ledger's index, its checkpoint); this
module adds the rest, the jobs it has read and that are not terminal yet, per queue, and the
oldest of them (:class:`PendingTracker`), and writes them all to ``stats.state`` in the journal
directory with each checkpoint save (:func:`save_snapshot`). The reader (:mod:`hybridq.ops.status`)
adds what the forwarder has not read yet, from the journal after the snapshot's positions.

The snapshot is a cache: replaced atomically (temp file, rename) but not fsync'd, and a missing,
damaged or stale one only sends :func:`hybridq.stats` to the full scan (docs/api.md).

This module must not import redis or rq.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hybridq.journal import ChainPosition
from hybridq.journal.format import segment_name
from hybridq.journal.reader import list_chains
from hybridq.journal.statefile import encode_state, read_state
from hybridq.ledger.checkpoint import CHECKPOINT_NAME, Checkpoint
from hybridq.ledger.compacted import Compacted
from hybridq.ledger.index import LedgerIndex
from hybridq.ledger.store import ledger_dir
from hybridq.lookup.pending import PendingTracker, job_fields

__all__ = ["STATS_NAME", "PendingTracker", "Snapshot", "job_fields", "load_snapshot", "save_snapshot"]

#: The snapshot's state file, in the journal directory (``stats.state``).
STATS_NAME = "stats"


@dataclass
class Snapshot:
    """The forwarder's figures as of one checkpoint save (see :func:`hybridq.stats`)."""

    positions: dict[str, ChainPosition] = field(default_factory=dict)
    #: The compaction state they were counted against (a compaction since makes them stale).
    compacted: dict[str, Any] = field(default_factory=dict)
    #: Ledger chains the forwarder's index holds all of (another process's writes: stale).
    ledger_chains: list[str] = field(default_factory=list)
    #: Records read, in segments not compacted.
    consumed: int = 0
    forwarded: int = 0
    duplicate_pushes: int = 0
    invalid: int = 0
    delayed_held: int = 0
    #: Outcomes in the ledger's index (not compacted): succeeded, failed, invalid, dups.
    outcomes: dict[str, int] = field(default_factory=dict)
    retrying: int = 0
    failed_listed: int = 0
    #: Pending jobs read, per queue, and the oldest one's creation time.
    queues: dict[str, int] = field(default_factory=dict)
    oldest_pending: float | None = None
    #: Cancels taken into the ledger whose jobs are not terminal yet.
    cancels: int = 0
    #: What the forwarder had written when it wrote this: its checkpoint file (inode, size,
    #: mtime) and its own ledger chain's last segment (chain, index, size). A forwarder that
    #: died after writing more never writes the snapshot that goes with it: a reader that sees
    #: them differ while no forwarder runs scans instead.
    checkpoint_file: list[int] | None = None
    ledger_tail: list[Any] | None = None
    #: Per queue, the window in Redis and the backlog behind it (docs/forwarder.md, "The window"):
    #: ``backlog``, ``window``, ``window_target``, ``oldest_waiting`` (a Unix time, or ``None``).
    queue_detail: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Redis's memory as the forwarder last read it: ``used``, ``maxmemory``, ``policy``,
    #: ``paused`` (``"high_water"``, ``"oom"`` or ``None``), ``last_oom`` (a Unix time).
    redis_memory: dict[str, Any] | None = None
    #: Per limit key its forwarder's gate looked at recently (hybridq.forwarder.keylimits): policy,
    #: running, queued, started, quarantine_s, room, blocked_since (a Unix time, or ``None``).
    limit_keys: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        checkpoint: Checkpoint,
        index: LedgerIndex,
        compacted: Compacted,
        tracker: PendingTracker,
        ledger_chains: Iterable[str],
        *,
        journal: str,
        own_chain: str | None,
    ) -> Snapshot:
        """The forwarder's figures now (its compacted segments dropped from ``tracker`` first)."""
        tracker.forget(compacted, checkpoint.positions)
        return cls(
            checkpoint_file=checkpoint_file(journal),
            ledger_tail=ledger_tail(journal, own_chain),
            positions=dict(checkpoint.positions),
            compacted=json.loads(compacted.to_bytes()),
            ledger_chains=sorted(ledger_chains),
            consumed=tracker.consumed,
            forwarded=checkpoint.forwarded,
            duplicate_pushes=checkpoint.duplicate_pushes,
            invalid=checkpoint.invalid,
            delayed_held=len(checkpoint.held),
            outcomes=dict(index.totals),
            retrying=len(index.retries),
            failed_listed=len(index.failed),
            queues=dict(tracker.pending),
            oldest_pending=tracker.oldest(),
            cancels=len(index.cancels),
        )

    def to_bytes(self) -> bytes:
        """JSON (``limit_keys`` last: its text is reused while it is the same object)."""
        body = {
            "v": 1,
            **{k: v for k, v in self.__dict__.items() if k not in ("positions", "limit_keys")},
            "positions": {w: p.to_json() for w, p in self.positions.items()},
        }
        head = json.dumps(body, separators=(",", ":"))
        return f'{head[:-1]},"limit_keys":{_limit_keys_json(self.limit_keys)}}}'.encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Snapshot:
        """Decode; ``ValueError`` (or ``KeyError``/``TypeError``) if it is not a snapshot."""
        body = json.loads(raw)
        if body.pop("v") != 1:
            raise ValueError("unknown snapshot version")
        body["positions"] = {w: ChainPosition.from_json(p) for w, p in body["positions"].items()}
        return cls(**body)


#: The last ``limit_keys`` encoded and its JSON text (see :func:`_limit_keys_json`).
_last_limit_keys: tuple[object, str] = (None, "{}")


def _limit_keys_json(figures: dict[str, dict[str, Any]]) -> str:
    """``figures`` as JSON, the text of the last call reused when given the same object again.

    The forwarder's key gate gives the same figures object for up to a second (it never changes
    one it gave): with 500 keys their JSON, made again at each of a burn's saves, cost about 4%
    of the forwarder's time.
    """
    global _last_limit_keys  # a one-entry cache, replaced whole (any thread)
    last = _last_limit_keys
    if last[0] is figures:
        return last[1]
    text = json.dumps(figures, separators=(",", ":"))
    _last_limit_keys = (figures, text)
    return text


def save_snapshot(journal: str, snapshot: Snapshot) -> None:
    """Rewrite ``stats.state`` in place (not fsync'd, not renamed: a cache, rebuilt each step).

    Replacing it by a rename made ext4 flush the new file's data at every step (its
    ``auto_da_alloc`` for a rename over an existing file: about 0.25 ms, most of a step's cost
    while completions stream in). A reader that catches the file mid-write, or after a crash
    mid-write, finds a length or checksum that does not match: :func:`load_snapshot` gives
    ``None`` and ``hybridq.stats`` scans instead, once.
    """
    path = os.path.join(journal, STATS_NAME + ".state")
    data = encode_state(snapshot.to_bytes())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        written = 0
        while written < len(data):
            written += os.pwrite(fd, data[written:], written)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def load_snapshot(journal: str) -> Snapshot | None:
    """The last snapshot; ``None`` when there is none or it does not decode (never an error)."""
    with contextlib.suppress(Exception):
        raw = read_state(journal, STATS_NAME)
        return None if raw is None else Snapshot.from_bytes(raw)
    return None


def checkpoint_file(journal: str) -> list[int] | None:
    """The forwarder's checkpoint file as it is now (inode, size, mtime); ``None`` if missing."""
    try:
        st = os.stat(os.path.join(journal, f"{CHECKPOINT_NAME}.state"))
    except FileNotFoundError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns]


def ledger_tail(journal: str, chain: str | None) -> list[Any] | None:
    """Chain ``chain``'s last ledger segment as it is now (chain, index, size); ``None``: none."""
    path = ledger_dir(journal)
    indices = list_chains(path).get(chain or "") if chain is not None and os.path.isdir(path) else None
    if not indices:
        return None
    try:
        size = os.stat(os.path.join(path, segment_name(chain or "", indices[-1]))).st_size
    except FileNotFoundError:
        return None
    return [chain, indices[-1], size]


def ledger_chains(path: str) -> Iterable[str]:
    """The chains of a ledger directory (none when it does not exist)."""
    return list_chains(path).keys() if os.path.isdir(path) else ()
