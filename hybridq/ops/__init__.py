"""The operator's answers: what is pending, stuck or failed, and is the journal healthy.

It owns :func:`hybridq.stats` and ``hybridq status`` (``status``), ``hybridq doctor`` (``doctor``),
the failed jobs and their requeue (``failures``), one job's trace (``trace``, ``trace_steps``),
the forwarder's Prometheus metrics (``metrics``) and ``hybridq journal repair`` with the forwarder
kept out (``journal_repair``). It reads what every role leaves behind, so it may use any of them
(the journal, the ledger, the lookup index, the producer, the forwarder's lock, the transport,
the worker's records in Redis); only the command line, the HTTP server and the test support
import it.
"""

from __future__ import annotations

from hybridq.lazy import lazy_names

__getattr__, __dir__ = lazy_names(globals(), {})
