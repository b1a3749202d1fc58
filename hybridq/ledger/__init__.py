"""The forwarder's durable records beside the journal: what happened to each job, and how far it got.

It owns the completion ledger (``store``: its directories, writers and readers; ``entries``: the
entry format; ``index``: the in-memory index; ``compacted``: the counts of compacted segments;
``segment_scan``: what compaction needs of one sealed segment),
the key store of finished jobs' idempotency keys, and the checkpoint (``checkpoint``: how far the
forwarder pushed, its held jobs). All of it is written with fsync, so that Redis losing a result
never re-runs a finished job (docs/reliability.md). It may use the journal, the envelope and the
protocol's enums; never Redis or RQ, and no role (the producer, the forwarder, the worker) that
reads it.
"""

from __future__ import annotations

from hybridq.lazy import lazy_names

__getattr__, __dir__ = lazy_names(globals(), {})
