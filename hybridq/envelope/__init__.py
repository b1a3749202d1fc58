"""The job envelope: the one record of a job, as the journal stores it and every process reads it.

It owns the job's fields and their checks (``model``: :class:`Envelope`, :class:`Retry`, job ids,
function paths), their types and ranges (``limits``) and their versioned JSON (``codec``). It may
use only :mod:`hybridq.errors` and the standard library: every role imports it, so it imports no
role, no journal and no Redis.
"""

from __future__ import annotations

from hybridq.lazy import lazy_names

__getattr__, __dir__ = lazy_names(globals(), {})
