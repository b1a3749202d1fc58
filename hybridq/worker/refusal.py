"""A run its limit key refused at the claim: its refused started event, sent right after the refusal.

The claim script (:mod:`hybridq.worker.scripts`) refuses a limited run whose key has no slot or
no rate left (docs/forwarder.md, "Limits per key"); the forwarder then takes the job back into
its run table on the word of the run's refused started event (``hybridq.forwarder.refusals``),
so the worker signs it as every event (docs/security.md): Lua cannot sign, and an event a Redis
writer could make must not take a job back. It is made and sent only when a claim is refused,
in a second call after the claim's reply: every limited claim used to carry it, signed, in
case its key refused, however rarely a key whose limit does not bind refuses (the workers' part
of what the limits cost per job, docs/benchmarks.md).

What the second call leaves: if it never gets through (the worker killed between the claim and
it, Redis unreachable past the retries, an error not retried, the signing key unreadable), the
refused copy is found stranded by the
forwarder's reconcile pass and delivered again (about two leases), as a refusal whose event
Redis lost always was. A reply lost and the call sent again adds the event twice: the forwarder
takes a job back once (``hybridq.forwarder.refusals.take_back``).
"""

from __future__ import annotations

import json
import logging
import time

import redis
from redis.exceptions import RedisError

from hybridq.protocol import Delivery, StartedEvent, keys
from hybridq.security.signing import SigningKeyError, sign_event
from hybridq.worker import scripts

__all__ = ["REFUSED", "is_limit_refusal", "send_refusal"]

log = logging.getLogger("hybridq.worker")

# KEYS: the owner's event stream. ARGV: the refused started event (signed), the why (the
# claim's reply; not signed: the forwarder believes it only with signing off). With the OOM
# guard, as the claim that refused: over maxmemory, the event still goes.
REFUSED = scripts.OOM_GUARD_LUA + 'return redis.call("XADD", KEYS[1], "*", "e", ARGV[1], "r", ARGV[2])\n'


def is_limit_refusal(d: Delivery, why: str) -> bool:
    """Whether a fenced claim's ``why`` is its limit key's refusal the owner wants to hear of."""
    return bool(d.limit) and d.report_start and why.startswith("limited")


def send_refusal(conn: redis.Redis, d: Delivery, why: str) -> None:
    """Tell ``d``'s forwarder its claim was refused (``why``): the job goes back to its run table.

    Retried while Redis is unreachable, as the claim is; given up with a warning after that
    (the reconcile pass then delivers the job again). Never raises for a Redis error or an
    unreadable signing key: the run is over either way (nothing ran, no attempt used).
    """
    event = StartedEvent(d.envelope.id, d.loc, d.attempt, d.later, time.time(), refused=True)
    try:
        body = json.dumps(sign_event(d.owner, event.to_json()))
        scripts.retrying(lambda: scripts.call(conn, REFUSED, [keys.events(d.owner)], [body, why]))
    except (RedisError, SigningKeyError) as exc:
        log.warning(
            "job %s attempt %d: its refusal not sent (%s): the forwarder delivers it again later",
            d.envelope.id,
            d.attempt,
            exc,
        )
