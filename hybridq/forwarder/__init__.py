"""The forwarder: the one daemon per journal directory that moves jobs from the journal to workers.

It owns the journal's reading side: it tails the segments, holds delayed jobs and retries, pushes
batches into a transport and moves its checkpoint only after the transport took them (``loop``,
``delivery``, ``wait``, ``push``, ``admission``, ``records``); then the completions side: it
harvests outcomes into the ledger, notices lost jobs and Redis losing its state, takes cancels
in and deletes dead segments (``upkeep``, ``harvest``, ``reconcile``, ``cancelling``,
``dead_segments``, ``watcher``), with its options and durable state in one place each
(``config``, ``state``). It may use the journal, the envelope, the protocol, the ledger, the
lookup index and the transport *port* (:class:`hybridq.transport.Transport`): never redis or rq
(only :mod:`hybridq.transport.rq` talks to them), the producer or the worker side.

:class:`Forwarder` and :class:`ForwarderConfig` load on first use from here (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridq.lazy import lazy_names

if TYPE_CHECKING:
    from .config import ForwarderConfig
    from .loop import LOCK_NAME, Forwarder

__all__ = ["LOCK_NAME", "Forwarder", "ForwarderConfig"]

_LAZY = {"LOCK_NAME": ".loop", "Forwarder": ".loop", "ForwarderConfig": ".config"}

__getattr__, __dir__ = lazy_names(globals(), _LAZY)
