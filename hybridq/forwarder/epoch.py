"""The forwarder's epoch in Redis: whether Redis lost state or restarted, and a new generation.

Redis losing the owner's epoch key, or restarting, bumps the epoch *generation*
(docs/reliability.md rule 15); the caller (:class:`hybridq.forwarder.reconcile.Reconciler`) then
runs a refill pass. Apart from the passes to keep each module short.

This module must not import redis or rq (the transport port only).
"""

from __future__ import annotations

import logging
import uuid

from hybridq.forwarder.state import ForwarderState
from hybridq.transport.base import Transport

__all__ = ["check_epoch"]

log = logging.getLogger("hybridq.forwarder")


def check_epoch(state: ForwarderState, transport: Transport) -> bool:
    """Whether Redis lost state or restarted since the epoch was set: then a refill pass is due.

    Either way the generation goes up, and the epoch key records it with the server's
    ``run_id``: workers refuse deliveries of an older generation (a snapshot or a lagging
    replica brings back queue entries of jobs that finished since), and every claim while
    the server's ``run_id`` is not the one recorded (it restarted, or a replica was promoted,
    and this forwarder has not looked yet). Why a generation and not only the token: Redis
    can bring back an older epoch key with its queue entries, and a generation orders them.
    """
    cp = state.checkpoint
    token = transport.state_token(cp.owner)
    if cp.epoch is not None and token.epoch == cp.epoch and token.run_id == cp.run_id:
        if _generation(cp.epoch) is None:
            # Set by a version without generations: the same epoch, in the fencing format.
            upgraded = f"{cp.generation}:{token.run_id}:{uuid.uuid4().hex}"
            state.set_epoch(upgraded, cp.run_id, cp.generation)
            transport.set_epoch(cp.owner, upgraded)
        return False
    refill = cp.epoch is not None or bool(cp.positions)
    # Above the generation Redis holds too (a checkpoint restored from a backup is behind it).
    generation = max(cp.generation, _generation(token.epoch or "") or 0) + 1 if refill else cp.generation
    epoch = f"{generation}:{token.run_id}:{uuid.uuid4().hex}"
    # Stored in Redis first, in the checkpoint by the forwarder's next save (before anything
    # is pushed under the new generation): a crash in between only repeats the refill, under
    # the same generation number; a Redis error changes nothing here (checked again later).
    transport.set_epoch(cp.owner, epoch)
    if not refill:
        log.info("setting this forwarder's epoch in Redis (owner %s)", cp.owner)
    elif token.epoch != cp.epoch:
        log.warning(
            "Redis lost or rolled back this forwarder's state (epoch key gone or older): "
            "re-forwarding every unfinished job, purging finished ones it brought back"
        )
    else:
        log.warning("Redis restarted (new run_id): re-forwarding what it does not have")
    state.set_epoch(epoch, token.run_id, generation)
    return refill


def _generation(epoch: str) -> int | None:
    """The generation an epoch token carries (``"gen:run_id:token"``); ``None`` for an older format."""
    head = epoch.split(":", 1)[0]
    return int(head) if ":" in epoch and head.isdigit() else None
