"""The workflows' file as the forwarder opens it, and what it holds back, read from it.

Created ``0600`` without following a symlink, its directory fsync'd (docs/reliability.md
rule 5), in WAL mode with ``synchronous=FULL``; a damaged file is refused, never moved aside.
Apart from :mod:`hybridq.forwarder.flows` (which moves the workflows on) to keep each module
short; the schema and the path are :mod:`hybridq.workflows.store`'s.

This module must not import redis or rq.
"""

from __future__ import annotations

import os
import sqlite3

from hybridq.errors import StateFileCorrupt
from hybridq.journal.fileops import OS_FILEOPS
from hybridq.transport.base import Loc
from hybridq.workflows.canvas import step_prefix
from hybridq.workflows.store import SCHEMA, path_of

__all__ = ["load_held", "open_flows_file"]


def open_flows_file(journal: str) -> sqlite3.Connection:
    """Open (or create) the workflows' file of ``journal``, its schema in place, no transaction open."""
    path = path_of(journal)
    if not os.path.isdir(os.path.dirname(path)):
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        OS_FILEOPS.fsync_dir(journal)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600))
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(SCHEMA)
    except sqlite3.DatabaseError as exc:
        db.close()
        # Not moved aside: the workflows it holds would never end (docs/workflows.md).
        raise StateFileCorrupt(path, f"the workflows' file is damaged: {exc}") from None
    OS_FILEOPS.fsync_dir(os.path.dirname(path))
    return db


def load_held(db: sqlite3.Connection) -> tuple[set[Loc], dict[str, str]]:
    """The locs held back (live workflows' anchors, waiting jobs), and live workflows by hashed id.

    The second maps the hash a long workflow id's steps start with to that id
    (:func:`hybridq.workflows.canvas.step_prefix`).
    """
    live = db.execute(
        "SELECT chain, seg, off FROM flows WHERE state = 'running' "
        "UNION ALL SELECT chain, seg, off FROM waits"
    )
    held = {(c, int(s), int(o)) for c, s, o in live}
    running = (str(fid) for (fid,) in db.execute("SELECT id FROM flows WHERE state = 'running'"))
    return held, {step_prefix(fid): fid for fid in running if step_prefix(fid) != fid}
