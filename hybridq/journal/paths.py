"""Validating and creating the journal directory (0700, never through a symlink).

A journal directory that every user may write to, or that another (non-root) user owns, is
refused: whoever can write it can plant jobs that run, or delete jobs that were acknowledged.
"""

from __future__ import annotations

import logging
import os
import stat

from hybridq.errors import JournalPathError

from .fileops import OS_FILEOPS, FileOps

__all__ = ["DEFAULT_JOURNAL", "ensure_journal_dir", "existing_journal_dir"]

log = logging.getLogger("hybridq.journal")

#: Used when neither ``--journal`` nor ``HYBRIDQ_JOURNAL`` is given; relative to the working directory.
DEFAULT_JOURNAL = "hybridq-journal"


def _check_existing(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise JournalPathError(path, "does not exist") from None
    except OSError as exc:
        raise JournalPathError(path, exc.strerror or str(exc)) from exc
    if stat.S_ISLNK(st.st_mode):
        # Following it could put the source of truth somewhere nobody meant; refuse instead.
        raise JournalPathError(path, "is a symlink; give the real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise JournalPathError(path, "exists and is not a directory")
    if st.st_mode & stat.S_IWOTH:
        # Anyone could plant a segment (jobs that would run) or delete one (jobs lost).
        raise JournalPathError(
            path, f"is writable by every user (mode {stat.S_IMODE(st.st_mode):o}); chmod 700 it"
        )
    euid = os.geteuid()
    if euid not in (0, st.st_uid):
        # Another user made it: they could read every job, and plant or remove segments.
        raise JournalPathError(path, f"is owned by uid {st.st_uid}, not by this user (uid {euid})")
    if st.st_mode & 0o077:
        log.warning(
            "journal directory %s is accessible to group/other (mode %o); 0700 is recommended",
            path,
            stat.S_IMODE(st.st_mode),
        )


def existing_journal_dir(path: str | os.PathLike[str]) -> str:
    """The absolute path of an existing journal directory, validated; never creates anything."""
    full = os.path.abspath(os.fspath(path))
    _check_existing(full)
    return full


def ensure_journal_dir(path: str | os.PathLike[str], fileops: FileOps = OS_FILEOPS) -> str:
    """Validate the journal directory, creating it ``0700`` (and its parents) when missing.

    Returns the absolute path. Raises :class:`JournalPathError` when the path is a symlink, is not
    a directory or is not writable; nothing is written in that case.
    """
    full = os.path.abspath(os.fspath(path))
    if not os.path.lexists(full):
        missing = []
        walk = full
        while not os.path.lexists(walk):
            missing.append(walk)
            walk = os.path.dirname(walk)
        for directory in reversed(missing):
            try:
                os.mkdir(directory, 0o700 if directory == full else 0o777)
            except FileExistsError:
                continue  # another process created it first; validated below
            except OSError as exc:  # e.g. a path component is a file
                raise JournalPathError(full, f"cannot create {directory}: {exc.strerror or exc}") from exc
            # A new directory entry is durable only once its parent is fsync'd (fsync(2)).
            fileops.fsync_dir(os.path.dirname(directory))
    _check_existing(full)
    if not os.access(full, os.W_OK | os.X_OK):
        raise JournalPathError(full, "is not writable by this user")
    return full
