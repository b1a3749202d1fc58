"""The task bodies every system runs: no-op, 20 ms of sleep (I/O-bound), ~5 ms of Python (CPU-bound).

Each appends one byte to the file named by ``$BURN_DONE_FILE`` when it has run (``O_APPEND``: one
``write`` per job, atomic on a local filesystem): the benchmark polls the file's size, the same
signal for every system, counted outside all of them. hybridq and RQ run these functions by their
dotted path (``burn.tasks.noop``); the peers' apps wrap them as their own tasks.
"""

from __future__ import annotations

import os
import time

#: Iterations of the CPU-bound loop: about 5 ms of pure Python on the machine of docs/benchmarks.md.
CPU_LOOPS = 140_000
IO_SECONDS = 0.02

_fd: list[int] = []  # the done file, opened once per process (a forked child may inherit it)


def _done() -> None:
    if not _fd:
        _fd.append(os.open(os.environ["BURN_DONE_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
    os.write(_fd[0], b".")


def noop() -> None:
    """Nothing but the done mark: what is measured is the queue."""
    _done()


def io() -> None:
    """An I/O-bound job: 20 ms waiting (a network call, say), no CPU."""
    time.sleep(IO_SECONDS)
    _done()


def cpu() -> int:
    """A CPU-bound job: ~5 ms of pure-Python arithmetic (holds the GIL throughout)."""
    x = 0
    for i in range(CPU_LOOPS):
        x += i * i % 7
    _done()
    return x


#: The workloads, by name: what ``--only`` selects.
WORKLOADS = {"noop": noop, "io": io, "cpu": cpu}
