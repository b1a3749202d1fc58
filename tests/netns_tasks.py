"""The task of the multihost scenarios (tests/multihost): it says which host ran it.

``hosted`` appends ``start <token> <attempt> <host> <pid> <time>``, sleeps, then ``done ...`` to
an effects file shared by every host (one file system, many network namespaces), so the test
counts runs per job and per worker host without trusting hybridq. The host is the worker's
``HQ_NETNS_HOST`` environment variable.
"""

from __future__ import annotations

import os
import time

from tests.tasks import _attempt, record


def hosted(path: str, token: str, sleep_s: float = 0.0) -> str:
    host = os.environ.get("HQ_NETNS_HOST", "?")
    attempt = _attempt()
    record(path, f"start {token} {attempt} {host} {os.getpid()} {time.time():.6f}")
    if sleep_s:
        time.sleep(sleep_s)
    record(path, f"done {token} {attempt} {host} {os.getpid()} {time.time():.6f}")
    return token
