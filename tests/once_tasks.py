"""Tasks for tests/crash/test_outbox_once_crash.py: an SMS whose effect is a row in SQLite.

The effect (an ``sms`` row) is written with ``outbox.once`` (or, for the comparison, without
it) and committed; on the job's first run the task then SIGKILLs its own process, after the
commit and before the worker stores the outcome. Every run is counted in ``runs`` (autocommit)
so the test sees that the job did run again.
"""

from __future__ import annotations

import os
import signal
import sqlite3

from hybridq.outbox import Outbox

outbox = Outbox()


def send_sms(db: str, order_id: int, use_once: bool, first_run_marker: str) -> int:
    conn = sqlite3.connect(db, timeout=30)
    try:
        with conn:
            conn.execute("INSERT INTO runs (order_id, pid) VALUES (?, ?)", (order_id, os.getpid()))
        with conn:
            if use_once:
                with outbox.once(conn) as first:
                    if first:
                        conn.execute("INSERT INTO sms (order_id) VALUES (?)", (order_id,))
            else:
                conn.execute("INSERT INTO sms (order_id) VALUES (?)", (order_id,))
    finally:
        conn.close()
    # Committed. The first run dies here: the outcome is never stored.
    try:
        fd = os.open(first_run_marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return order_id
    os.write(fd, str(os.getpid()).encode())
    os.fsync(fd)
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")
