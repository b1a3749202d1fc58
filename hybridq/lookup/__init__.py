"""Derived read models: one job by id, and the totals, without scanning the journal or the ledger.

It owns the lookup index the forwarder keeps (``index`` writes it, ``store`` is its SQLite file,
``reads`` answers :func:`hybridq.fetch_job`) and the stats snapshot (``stats``: the figures
:func:`hybridq.stats` reads instead of scanning). Both are caches: not fsync'd, rebuilt from the
journal and the ledger when missing, damaged or stale. It may use the journal, the envelope, the
protocol and the ledger; never Redis or RQ.

:data:`RETENTION_S`, how long a finished job stays in the index, loads on first use from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridq.lazy import lazy_names

if TYPE_CHECKING:
    from .reads import RETENTION_S

__all__ = ["RETENTION_S"]

__getattr__, __dir__ = lazy_names(globals(), {"RETENTION_S": ".reads"})
