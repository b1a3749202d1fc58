"""Tasks for the backlog tests (tests/integration/test_backlog_window.py): cheap, counted from a file.

``mark`` appends one line per run without an fsync (the workers are never killed in those
tests, and an fsync per job would make a 10,000-job drain a test of the disk).
"""

from __future__ import annotations

import os


def mark(path: str, token: str, pad: str = "") -> str:
    """Append ``token`` to ``path`` (one ``O_APPEND`` write: lines of concurrent runs never mix)."""
    del pad  # it only makes the job as big as a real one's arguments
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{token}\n".encode())
    finally:
        os.close(fd)
    return token
