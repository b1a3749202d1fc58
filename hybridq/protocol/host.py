"""``host/pid``, how lease tokens and completion events name a worker (part of :mod:`hybridq.protocol`).

Cached per process, and forgotten in a forked child (the pool forks its workers).
"""

from __future__ import annotations

import os
import socket

__all__ = ["host_pid"]

_HOST_PID: list[str] = []


def host_pid() -> str:
    """``host/pid`` of this process: how lease tokens and completion events name a worker.

    Looked up once per process (again after a fork: ``os.getpid()`` is a system call, and this
    is asked a few times per job).
    """
    if not _HOST_PID:
        _HOST_PID.append(f"{socket.gethostname()}/{os.getpid()}")
    return _HOST_PID[0]


def _forget_host_pid() -> None:
    _HOST_PID.clear()


os.register_at_fork(after_in_child=_forget_host_pid)
