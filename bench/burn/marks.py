"""The job of the burn-down under faults (``bench/burndown_faults.py``): one line per run.

Each run appends ``job_id pid time`` as one line to the file named by ``$BURN_DONE_FILE``
(``O_APPEND``, one ``write`` under ``PIPE_BUF``: lines never interleave), so the benchmark sees
from outside hybridq which job ran, how many times, in which process and when. It imports
hybridq (for the job id), so it lives apart from :mod:`burn.tasks`, which the peers import too.
"""

from __future__ import annotations

import os
import time

from hybridq import current_job

_fd: list[int] = []  # the file, opened once per process (a forked child may inherit it)


def mark() -> None:
    """A no-op job that notes its run: job id, pid, time."""
    job = current_job()
    if not _fd:
        _fd.append(os.open(os.environ["BURN_DONE_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
    os.write(_fd[0], f"{job.id if job else '?'} {os.getpid()} {time.time():.6f}\n".encode())
