"""Validating and creating the journal directory (0700, never through a symlink).

A journal directory that every user may write to, or that another (non-root) user owns, is
refused: whoever can write it can plant jobs that run, or delete jobs that were acknowledged.
So is a journal path that another user could redirect: every directory on the way to it (each
symlink followed and its own directory checked too) must belong to root or to this user and be
writable by nobody else, unless it is sticky (like ``/tmp``) and the entry in it is ours or
root's. Whoever can write a parent can otherwise rename the journal away and put a planted one
(or a symlink to one) in its place between two operations that use the path
(``docs/security.md``, *The journal directory*).
"""

from __future__ import annotations

import logging
import os
import stat

from hybridq.errors import ConfigError, JournalPathError

from .fileops import OS_FILEOPS, FileOps

__all__ = [
    "NO_JOURNAL",
    "check_journal_dir",
    "default_journal",
    "ensure_journal_dir",
    "existing_journal_dir",
    "open_journal_dir",
]

log = logging.getLogger("hybridq.journal")

#: What :func:`default_journal` raises without ``HYBRIDQ_JOURNAL``: no journal is created in the
#: working directory unless someone asked for one (a test run, a script started in ``$HOME``).
NO_JOURNAL = (
    "no journal configured: pass journal=PATH (Queue(name, journal=...) or @hybridq.task(journal=...)), "
    "set HYBRIDQ_JOURNAL, or in tests use hybridq.testing (docs/testing.md)"
)


def default_journal() -> str:
    """``$HYBRIDQ_JOURNAL`` (read when called, not at import).

    Raises:
        ConfigError: it is not set (:data:`NO_JOURNAL` says how to set one).
    """
    journal = os.environ.get("HYBRIDQ_JOURNAL")
    if not journal:
        raise ConfigError(NO_JOURNAL)
    return journal


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


#: How many symlinks a journal path may go through (as the kernel's ELOOP limit).
_MAX_LINKS = 40


def _trusted_uids(full: str) -> frozenset[int]:
    """Root, us, and (when we are root) the journal's owner, who controls its contents anyway.

    So root may still look at any user's journal in that user's home (``hybridq status``).
    """
    euid = os.geteuid()
    if euid != 0:
        return frozenset((0, euid))
    try:
        return frozenset((0, os.lstat(full).st_uid))
    except OSError:
        return frozenset((0,))


def _check_entry(
    full: str, trusted: frozenset[int], parent: str, parent_st: os.stat_result, name: str, st: os.stat_result
) -> None:
    """Refuse when a user we do not trust could replace ``name`` in ``parent``."""
    if parent_st.st_uid not in trusted:
        raise JournalPathError(
            full, f"its parent {parent} is owned by uid {parent_st.st_uid}, who could replace {name!r} in it"
        )
    mode = parent_st.st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not (mode & stat.S_ISVTX and st.st_uid in trusted):
        raise JournalPathError(
            full,
            f"its parent {parent} is writable by other users (mode {stat.S_IMODE(mode):o}), who could "
            f"swap in another journal; chmod go-w {parent}, or choose a directory only you can write",
        )


def _check_ancestors(full: str) -> None:
    """Walk ``full`` from ``/`` as the kernel resolves it, checking every directory on the way.

    Symlinks are followed (each link's own directory was checked before it, its target is walked
    next), so a link in the middle cannot lead through a directory someone else controls. Stops
    at the first component that does not exist yet (whoever creates it checks again).
    """
    trusted = _trusted_uids(full)
    todo = [part for part in reversed(full.split("/")) if part]
    current, current_st = "/", os.lstat("/")
    links = 0
    while todo:
        name = todo.pop()
        if name == ".":
            continue
        if name == "..":
            current = os.path.dirname(current)
            current_st = os.lstat(current)
            continue
        entry = os.path.join(current, name)
        try:
            st = os.lstat(entry)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise JournalPathError(full, f"cannot check {entry}: {exc.strerror or exc}") from exc
        _check_entry(full, trusted, current, current_st, name, st)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise JournalPathError(full, "goes through too many symlinks")
            target = os.readlink(entry)
            if target.startswith("/"):
                current, current_st = "/", os.lstat("/")
            todo.extend(part for part in reversed(target.split("/")) if part)
            continue
        if not stat.S_ISDIR(st.st_mode):
            return  # refused by _check_existing (or by mkdir), with a clearer message
        current, current_st = entry, st


def existing_journal_dir(path: str | os.PathLike[str]) -> str:
    """The absolute path of an existing journal directory, validated; never creates anything."""
    full = os.path.abspath(os.fspath(path))
    _check_existing(full)
    _check_ancestors(full)
    return full


def ensure_journal_dir(path: str | os.PathLike[str], fileops: FileOps = OS_FILEOPS) -> str:
    """Validate the journal directory, creating it ``0700`` (and its parents) when missing.

    Returns the absolute path. Raises :class:`JournalPathError` when the path is a symlink, is not
    a directory, is not writable, or goes through a directory another user could change (see the
    module docstring); nothing is written in that case (but missing parents, created ``0755``).
    """
    full = os.path.abspath(os.fspath(path))
    _check_ancestors(full)  # before creating anything under them
    if not os.path.lexists(full):
        missing = []
        walk = full
        while not os.path.lexists(walk):
            missing.append(walk)
            walk = os.path.dirname(walk)
        for directory in reversed(missing):
            try:
                # Parents 0755 whatever the umask lets through: never writable by others
                # (0777 & ~umask let any local user swap the journal below them).
                os.mkdir(directory, 0o700 if directory == full else 0o755)
            except FileExistsError:
                continue  # another process created it first; validated below
            except OSError as exc:  # e.g. a path component is a file
                raise JournalPathError(full, f"cannot create {directory}: {exc.strerror or exc}") from exc
            # A new directory entry is durable only once its parent is fsync'd (fsync(2)).
            fileops.fsync_dir(os.path.dirname(directory))
        _check_existing(full)
        _check_ancestors(full)  # again: the directories just made, and what raced with them
    else:
        _check_existing(full)
    if not os.access(full, os.W_OK | os.X_OK):
        raise JournalPathError(full, "is not writable by this user")
    return full


def open_journal_dir(full: str) -> int:
    """Open the (validated) journal directory itself, never through a symlink; returns the fd.

    A long-running process (the journal's reader) keeps it: files it opens relative to it
    (``dir_fd=``) are in this directory whatever happens to the path, and
    :func:`check_journal_dir` tells it when the path no longer leads here.
    """
    try:
        fd = os.open(full, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise JournalPathError(full, f"cannot open it: {exc.strerror or exc}") from exc
    try:
        check_journal_dir(fd, full)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_journal_dir(fd: int, full: str) -> None:
    """Raise :class:`JournalPathError` unless ``full`` still names the directory open as ``fd``.

    A different directory or a symlink at the path means someone replaced the journal.
    """
    held = os.fstat(fd)
    try:
        now = os.lstat(full)
    except OSError as exc:
        raise JournalPathError(
            full, f"is gone ({exc.strerror or exc}) since it was opened; stopping"
        ) from exc
    if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
        raise JournalPathError(
            full, "was replaced (another directory or a symlink now stands at that path); stopping"
        )
