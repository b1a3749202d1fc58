"""Secret files (the Redis password, envelope signing keys): read them, warn when others may.

A secret belongs in a file only its owner can read (``0600``), never on a command line (``ps``
shows it to every user). A file that group or other may read still works, with a warning naming
it and its mode; the secret itself is never logged.

This module imports nothing from hybridq but its errors, so the worker side, the producer and
the CLI all use it.
"""

from __future__ import annotations

import logging
import os

from hybridq.errors import HybridqError

__all__ = ["read_password", "read_secret_file"]

log = logging.getLogger("hybridq")


def read_secret_file(path: str) -> str:
    """The text of the secret file at ``path`` (a warning if group or other may read it)."""
    st = os.stat(path)
    if st.st_mode & 0o077:
        log.warning("%s is readable by group/other (mode %o): make it 0600", path, st.st_mode & 0o777)
    with open(path, encoding="utf-8") as f:
        return f.read()


def read_password(path: str) -> str:
    """The first line of a password file (refused if empty; a warning if others may read it)."""
    password = read_secret_file(path).partition("\n")[0].rstrip("\r\n")
    if not password:
        raise HybridqError(f"{path}: the password file is empty")
    return password
