"""How long a worker's Redis call is sent again, and after which errors (:func:`retrying`).

Apart from :mod:`hybridq.worker.scripts`, which sends the calls and re-exports these names.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from redis.exceptions import NoScriptError, OutOfMemoryError, ReadOnlyError, RedisError, ResponseError

__all__ = ["FINISH_PATIENCE_S", "retrying", "transient"]

log = logging.getLogger("hybridq.worker")

#: How long to keep trying to record an outcome while Redis is unreachable (seconds). Past it,
#: the lease expires and the forwarder delivers the job again: at-least-once, never lost.
FINISH_PATIENCE_S = 30.0


def retrying(call: Any) -> Any:
    """Run a Redis call, retrying while Redis is unreachable, for up to FINISH_PATIENCE_S.

    An error that would come back the same (a script's own error: :func:`transient`) is raised
    at once.
    """
    deadline = time.monotonic() + FINISH_PATIENCE_S
    delay = 0.1
    while True:
        try:
            return call()
        except RedisError as exc:
            if not transient(exc):
                raise
            if time.monotonic() >= deadline:
                log.error("cannot reach Redis (%s): the job will be delivered again", exc)
                raise
            time.sleep(random.uniform(delay / 2, delay))  # noqa: S311 - jitter
            delay = min(2.0, delay * 2)


#: Redis's error codes that a later try may not meet (memory, a replica, loading, failover).
_TRANSIENT_CODES = (
    "OOM",
    "READONLY",
    "LOADING",
    "BUSY",
    "MASTERDOWN",
    "TRYAGAIN",
    "NOREPLICAS",
    "CLUSTERDOWN",
)


def transient(exc: RedisError) -> bool:
    """Whether a call that failed with ``exc`` may succeed if sent again.

    Connection errors and timeouts may; so may Redis's refusals of the moment (out of memory, a
    read-only replica, a script Redis does not know yet), also when a script met them. Another
    error reply (a key of the wrong type, a script's own error) would come back the same.
    """
    if not isinstance(exc, ResponseError) or isinstance(
        exc, (OutOfMemoryError, ReadOnlyError, NoScriptError)
    ):
        return True
    text = str(exc)
    return any(text.startswith(f"{code} ") or f": {code} " in text for code in _TRANSIENT_CODES)
