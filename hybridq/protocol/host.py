"""``host/pid``, how lease tokens and completion events name a worker (part of :mod:`hybridq.protocol`).

Cached per process, and forgotten in a forked child (the pool forks its workers); with the
random part of a lease token (:func:`token_nonce`).
"""

from __future__ import annotations

import os
import socket

from hybridq.envelope.names import random_bytes

__all__ = ["host_pid", "token_nonce"]

_HOST_PID: list[str] = []


def host_pid() -> str:
    """``host/pid`` of this process: how lease tokens and completion events name a worker.

    Looked up once per process (again after a fork: ``os.getpid()`` is a system call, and this
    is asked a few times per job).
    """
    if not _HOST_PID:
        _HOST_PID.append(f"{socket.gethostname()}/{os.getpid()}")
    return _HOST_PID[0]


def token_nonce() -> str:
    """8 random hex digits, the last part of a lease token (``id/attempt/host/pid/nonce``).

    They tell apart processes that ``host/pid`` alone does not: a pid used again (a pool child
    that ended and one forked later), containers of the same host name, a process copied other
    than by ``os.fork`` (a VM or container snapshot restored twice: a generator seeded once per
    process would repeat its tokens there, and two runs would share one lease). So a getrandom
    call per token, as for job ids, but made holding the GIL: ``os.urandom`` lets it go around
    the system call at every job, and the lease renewer and the batch threads then take it while
    the run waits to get it back.
    """
    return random_bytes(4).hex()


def _forget_host_pid() -> None:
    _HOST_PID.clear()


os.register_at_fork(after_in_child=_forget_host_pid)
