"""The forwarder's durable state: its checkpoint, held delayed jobs and counters.

Stored as one atomic state file (``forwarder.state`` in the journal directory) by
:mod:`hybridq.journal.statefile`. A missing checkpoint means "forward everything from the start"
(duplicates, never loss); a damaged one is an error the operator must look at.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from hybridq.errors import StateFileCorrupt
from hybridq.journal import ChainPosition
from hybridq.journal.ownerlock import lock_owner
from hybridq.journal.reader import clamp_to_seals
from hybridq.journal.statefile import read_state, write_state

__all__ = [
    "CHECKPOINT_NAME",
    "EPOCHS_KEPT",
    "LOCK_NAME",
    "Checkpoint",
    "Held",
    "clamp_checkpoint",
    "forwarder_holder",
    "load_checkpoint",
    "save_checkpoint",
]

CHECKPOINT_NAME = "forwarder"
#: The forwarder's owner lock in the journal directory: held (``flock``) while one runs.
LOCK_NAME = "forwarder.lock"
#: How many generation changes the checkpoint remembers (:attr:`Checkpoint.epochs`).
EPOCHS_KEPT = 32


@dataclass(frozen=True, slots=True, order=True)
class Held:
    """A delayed job read from the journal and held until ``run_at`` (sorted by it)."""

    run_at: float
    job_id: str
    writer_id: str
    segment: int
    offset: int


@dataclass
class Checkpoint:
    """Where forwarding stands. Never ahead of what the transport accepted (invariant 5)."""

    positions: dict[str, ChainPosition] = field(default_factory=dict)
    held: list[Held] = field(default_factory=list)
    #: Jobs pushed to the transport (a job re-pushed after a crash counts again).
    forwarded: int = 0
    #: Pushes the transport reported as already known (the duplicate pushes that ids absorbed).
    duplicate_pushes: int = 0
    #: Records that were valid journal records but not valid envelopes (skipped, logged).
    invalid: int = 0
    #: This forwarder's name in Redis (its event stream and epoch key); made once, kept forever.
    owner: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    #: The epoch token last stored in Redis, and the Redis run id it was stored under.
    epoch: str | None = None
    run_id: str | None = None
    #: The epoch generation: bumped each time Redis restarted or lost the epoch key. Every
    #: delivery carries the generation it was pushed under, and workers refuse one older than
    #: the generation in the epoch key (see ``Reconciler.check_epoch``).
    generation: int = 0
    #: Jobs durably terminal (ledger and compacted segments), as of this save: producers read it
    #: for their capacity check without reading the ledger.
    terminal: int = 0
    #: When the generation went up (Redis lost or rolled back state: every unfinished job was
    #: pushed again), as ``(generation, time)``, the last :data:`EPOCHS_KEPT`; for job traces.
    epochs: list[tuple[int, float]] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        """JSON encoding."""
        body: dict[str, Any] = {
            "v": 1,
            "positions": {w: p.to_json() for w, p in self.positions.items()},
            "held": [[h.run_at, h.job_id, h.writer_id, h.segment, h.offset] for h in self.held],
            "forwarded": self.forwarded,
            "duplicate_pushes": self.duplicate_pushes,
            "invalid": self.invalid,
            "owner": self.owner,
            "epoch": self.epoch,
            "run_id": self.run_id,
            "generation": self.generation,
            "terminal": self.terminal,
        }
        if self.epochs:  # left out while empty: an older version reads the state unchanged
            body["epochs"] = [list(e) for e in self.epochs]
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, path: str) -> Checkpoint:
        """Decode; a malformed body raises :class:`StateFileCorrupt`."""
        try:
            body = json.loads(raw)
            return cls(
                positions={w: ChainPosition.from_json(p) for w, p in body["positions"].items()},
                held=sorted(Held(float(a), str(b), str(c), int(d), int(e)) for a, b, c, d, e in body["held"]),
                forwarded=int(body["forwarded"]),
                duplicate_pushes=int(body["duplicate_pushes"]),
                invalid=int(body.get("invalid", 0)),
                owner=str(body.get("owner") or uuid.uuid4().hex[:16]),
                epoch=body.get("epoch"),
                run_id=body.get("run_id"),
                generation=int(body.get("generation", 0)),
                terminal=int(body.get("terminal", 0)),
                epochs=[(int(g), float(t)) for g, t in body.get("epochs", [])],
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise StateFileCorrupt(path, f"malformed checkpoint: {exc!r}") from exc


def load_checkpoint(journal: str) -> Checkpoint | None:
    """The saved checkpoint, ``None`` if there is none yet."""
    raw = read_state(journal, CHECKPOINT_NAME)
    if raw is None:
        return None
    return Checkpoint.from_bytes(raw, f"{journal}/{CHECKPOINT_NAME}.state")


def save_checkpoint(journal: str, checkpoint: Checkpoint) -> None:
    """Durably replace the checkpoint (temp file, fsync, rename, directory fsync)."""
    write_state(journal, CHECKPOINT_NAME, checkpoint.to_bytes())


def forwarder_holder(journal: str) -> str | None:
    """Who holds ``journal``'s forwarder lock (``"forwarder pid N on HOST"``); ``None``: no forwarder runs.

    The kernel drops the lock when its holder dies, so ``None`` also means a forwarder that was
    killed: nothing moves the journal's jobs on until one starts.
    """
    return lock_owner(os.path.join(journal, LOCK_NAME))


def clamp_checkpoint(journal: str, checkpoint: Checkpoint) -> None:
    """Move positions that point past a segment's data back to its seal, saved (see clamp_to_seals).

    At the forwarder's start, before anything is read.
    """
    moved = clamp_to_seals(journal, checkpoint.positions)
    for writer_id, position in moved.items():
        logging.getLogger("hybridq.forwarder").warning(
            "checkpoint for writer %s pointed past the durable end of segment %d (records "
            "read before they were durable, dropped since as a torn tail); resuming at %d",
            writer_id,
            position.segment,
            position.offset,
        )
        checkpoint.positions[writer_id] = position
    if moved:
        save_checkpoint(journal, checkpoint)
