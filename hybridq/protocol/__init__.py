"""The wire contract between hybridq's processes, which may run on different hosts and versions.

The package owns what processes say to each other and where they meet: the messages below, the
Redis keys they are stored under (:mod:`~hybridq.protocol.keys`), the datagram that wakes the
forwarder (:mod:`~hybridq.protocol.nudge`) and what a run that raised ``RetryLater`` comes to
for every kind of worker (:mod:`~hybridq.protocol.later`). It may use only the envelope and
:mod:`hybridq.errors`: never redis, rq or the journal, so that every process may import it.

Three messages cross Redis:

* a :class:`Delivery` (forwarder → worker): the single argument of the RQ job whose function is
  :data:`ENTRY_POINT`, as :meth:`Delivery.to_json` makes it and :meth:`Delivery.from_json` reads
  it;
* a :class:`StoredOutcome` (worker → worker): what a run stores under its idempotency key, read
  by the claim and outcome scripts (``hybridq.worker.scripts``) of every later delivery;
* a :class:`CompletionEvent` (worker → forwarder): one entry of the owner's event stream, built
  by :meth:`CompletionEvent.of` (by the workers and by the memory transport's simulated
  worker alike) and checked field by field by :meth:`CompletionEvent.from_json` before it
  reaches the forwarder's ledger. With signing keys a worker adds a MAC to the event
  (``hybridq.security.signing.sign_event``), which the forwarder checks before it parses the event.

The enums are ``str`` (or ``int``) enums whose values are the very strings (numbers) on the
wire, so the JSON, the Lua scripts' replies and the ledger records are what they were.

This module is the one import path for the messages' names; each part lives in its own module:
:mod:`~hybridq.protocol.enums` (the enums), :mod:`~hybridq.protocol.delivery` (the delivery, the
entry point and the defaults), :mod:`~hybridq.protocol.outcome` (the stored outcome),
:mod:`~hybridq.protocol.events` (the completion and started events) and
:mod:`~hybridq.protocol.host` (:func:`host_pid`).
"""

from __future__ import annotations

from hybridq.protocol.delivery import (
    DEFAULT_KEY_TTL_S,
    DEFAULT_LEASE_S,
    DELIVERY_VERSION,
    ENTRY_POINT,
    Delivery,
    Loc,
)
from hybridq.protocol.enums import ClaimStatus, EntryKind, FinishReply, Outcome, Overwrite, Verdict
from hybridq.protocol.events import (
    EVENT_ERROR_CHARS,
    RESULT_MAX_BYTES,
    STARTED,
    WORKER_MAX_CHARS,
    CompletionEvent,
    StartedEvent,
)
from hybridq.protocol.host import host_pid
from hybridq.protocol.outcome import StoredOutcome

__all__ = [
    "DEFAULT_KEY_TTL_S",
    "DEFAULT_LEASE_S",
    "DELIVERY_VERSION",
    "ENTRY_POINT",
    "EVENT_ERROR_CHARS",
    "RESULT_MAX_BYTES",
    "STARTED",
    "WORKER_MAX_CHARS",
    "ClaimStatus",
    "CompletionEvent",
    "Delivery",
    "EntryKind",
    "FinishReply",
    "Loc",
    "Outcome",
    "Overwrite",
    "StartedEvent",
    "StoredOutcome",
    "Verdict",
    "host_pid",
]
