"""What a worker may run, and who wrote it: Redis write access must not mean code execution.

It owns the allowlist of functions a worker may import and call (``allow``), the HMAC signatures
of envelopes and completion events (``signing``) and the reading of secret files, the signing keys
and the Redis password (``secretfile``). It may use the envelope and :mod:`hybridq.errors`; never
Redis, RQ or the journal, so that the producer, the forwarder and the worker share it
(docs/security.md).
"""

from __future__ import annotations

from hybridq.lazy import lazy_names

__getattr__, __dir__ = lazy_names(globals(), {})
