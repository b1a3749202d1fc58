"""``host/pid``, how lease tokens and completion events name a worker (part of :mod:`hybridq.protocol`).

Cached per process, and forgotten in a forked child (the pool forks its workers); with the
random part of a lease token (:func:`token_nonce`).
"""

from __future__ import annotations

import os
import random
import socket

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


#: The generator of :func:`token_nonce`: seeded from the kernel at import, again in a forked child.
_NONCE = random.Random(os.urandom(16))  # noqa: S311 - told apart, not kept secret: see token_nonce


def token_nonce() -> str:
    """8 random hex digits, the last part of a lease token (``id/attempt/host/pid/nonce``).

    They tell apart processes that ``host/pid`` alone does not: a pid used again (a pool child
    that ended and one forked later), containers of the same host name. A generator seeded from
    the kernel once per process does that as well as a read per token, whose ``os.urandom``
    lets the GIL go around its system call at every job (the lease renewer and the batch
    threads then take it, and the run waits to get it back). A token is compared, never guessed
    against: nothing is kept secret by it. A process restored twice from one snapshot repeats
    these, but it already repeats the tokens of every run it held at the snapshot.
    """
    return _NONCE.getrandbits(32).to_bytes(4).hex()


def _forget_host_pid() -> None:
    _HOST_PID.clear()
    # A child forked later with a pid used before must not repeat that child's tokens.
    _NONCE.seed(os.urandom(16))


os.register_at_fork(after_in_child=_forget_host_pid)
