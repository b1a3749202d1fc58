"""The ledger index's spill files as files: where they are, their names, descriptors and room.

:class:`~hybridq.ledger.outcome_spill.SpilledArrays` lays a spilled map out in a file and reads
it; this module manages the files themselves (issue 29; docs/forwarder.md, "Memory: the bound
that holds now"):

* where: :data:`SPILL_DIR` of the journal's directory (on the journal's disk, not a tmpfs; a dot
  name: no journal reader lists it, docs/journal-format.md), made 0700, never through a symlink;
* names: a token drawn once a process (a forked child draws its own: it never removes its
  parent's files) and the map's serial; a file is removed when its map is dropped or read back
  (:func:`release`), and what a kill leaves is removed by the next start (:func:`sweep`, under
  the forwarder's owner lock: no other process spills into that journal). The files are a
  runtime representation only: never fsync'd, never read by another process;
* descriptors: at most :data:`OPEN_MAX` open at once, the least recently used closed past it and
  opened again by name when looked up (:func:`descriptor`), so any number of spilled maps fits
  under ``RLIMIT_NOFILE``;
* room: a write that would leave less than :func:`margin` free on the disk is refused
  (:class:`SpillRefused`), and after a refusal or a failed write nothing is written for
  :data:`BACKOFF_S` (:func:`paused`): the journal's producers' appends must not meet a disk the
  spill filled. :func:`spill_failed` logs it, once an episode.

This module must not import redis or rq.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import time
from collections import OrderedDict

__all__ = [
    "BACKOFF_S",
    "FREE_MIN_BYTES",
    "FREE_MIN_FRACTION",
    "OPEN_MAX",
    "SPILL_DIR",
    "SpillRefused",
    "create",
    "descriptor",
    "margin",
    "path",
    "pause",
    "paused",
    "release",
    "room",
    "spill_failed",
    "sweep",
    "written",
]

log = logging.getLogger("hybridq.ledger")

#: The spill files' directory, in the journal's (made 0700 by the first spill).
SPILL_DIR = ".index-spill"
#: Spill files open at once; the least recently used is closed past it (opened again by name).
OPEN_MAX = 32
#: The free space a write must leave on the journal's disk: the larger of these two. 256 MiB is
#: four default segments (64 MiB) of the producers' appends; 5 % keeps a large disk's last
#: twentieth for the journal, where most file systems slow down and operators' alerts fire.
FREE_MIN_BYTES = 256 << 20
FREE_MIN_FRACTION = 0.05
#: Seconds with no write to a spill file after a write failed or was refused for room.
BACKOFF_S = 60.0


class SpillRefused(OSError):
    """A write not tried: too little room on the disk, or within :data:`BACKOFF_S` of a failure."""


#: The open descriptors, by file serial, least recently used first (at most :data:`OPEN_MAX`).
_open: OrderedDict[int, int] = OrderedDict()
#: This process's files' names start with it (a forked child draws its own: it never removes
#: its parent's); :func:`sweep` removes the others.
_token = os.urandom(8).hex()
#: A spill file's name: the token of the process that made it and a serial (what :func:`sweep` removes).
_NAME = re.compile(r"[0-9a-f]{16}-[0-9]+")
#: The journal directories swept by this process, and their spill directories made.
_swept: set[str] = set()
_made: set[str] = set()
#: No write before this (:func:`time.monotonic`): a write failed or was refused for room.
_resume_at = 0.0
_clock = time.monotonic
#: Warned since the last write that succeeded (one warning an episode).
_warned = False


def _forked() -> None:
    global _token
    _token = os.urandom(8).hex()
    while _open:
        os.close(_open.popitem()[1])


os.register_at_fork(after_in_child=_forked)


def create(directory: str, serial: int) -> str:
    """Make and open file ``serial`` of this process in ``directory``'s spill directory (0600).

    Returns the token that names it with ``serial`` (:func:`path`); its descriptor is kept
    (:func:`descriptor`). ``OSError``: no file made.
    """
    where = _spill_dir(directory)
    token = _token
    name = f"{token}-{serial}"
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(os.path.join(where, name), flags, 0o600)
    except FileNotFoundError:  # the directory removed meanwhile: made again
        _made.discard(where)
        fd = os.open(os.path.join(_spill_dir(directory), name), flags, 0o600)
    _opened(serial, fd)
    return token


def path(directory: str, owner: str, serial: int) -> str:
    """The path of file ``serial`` made by the process of token ``owner`` (empty: no owner, closed)."""
    if not owner:
        return ""
    return os.path.join(directory, SPILL_DIR, f"{owner}-{serial}")


def descriptor(directory: str, owner: str, serial: int) -> int:
    """File ``serial``'s descriptor: open already, or opened again by name (``OSError``).

    A reopen that meets ``EMFILE``/``ENFILE`` (the process's descriptors used up elsewhere)
    closes the files kept open first, then tries once more.
    """
    fd = _open.get(serial)
    if fd is None:
        where = path(directory, owner, serial)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(where, flags)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE) or not _open:
                raise
            while _open:
                os.close(_open.popitem()[1])
            fd = os.open(where, flags)
        _opened(serial, fd)
    else:
        _open.move_to_end(serial)
    return fd


def release(serial: int, owner: str, where: str) -> None:
    """Close file ``serial`` and remove it at ``where``, never a file of another process's."""
    fd = _open.pop(serial, None)
    if fd is not None:
        os.close(fd)
    if owner and owner == _token:
        try:
            os.unlink(where)
        except OSError as exc:  # gone already, or left for the next start's sweep
            log.debug("%s: not removed: %s", where, exc)


def _opened(serial: int, fd: int) -> None:
    """Keep ``fd`` open for file ``serial``, closing the least recently used past :data:`OPEN_MAX`."""
    _open[serial] = fd
    while len(_open) > OPEN_MAX:
        os.close(_open.popitem(last=False)[1])


def _spill_dir(directory: str) -> str:
    """The spill directory of ``directory``, made (0700) if missing; never through a symlink."""
    where = os.path.join(directory, SPILL_DIR)
    if where not in _made:
        try:
            os.mkdir(where, 0o700)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(where).st_mode):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", where) from None
        _made.add(where)
    return where


def sweep(directory: str) -> None:
    """Remove the spill files of other processes in ``directory`` (a journal's), once a process.

    They are a killed forwarder's (only the forwarder holding the journal's owner lock spills
    into it, ``hybridq/forwarder/dirlock.py``), never read again. Only regular files named as
    a spill file (:data:`_NAME`) are removed, through the directory opened without following a
    symlink: a ``.index-spill`` that is a symlink (to the journal itself, say) is left alone,
    with a warning, and nothing else is removed. One that cannot be removed is logged and left.
    """
    if not directory or directory in _swept:
        return
    _swept.add(directory)
    where = os.path.join(directory, SPILL_DIR)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as exc:  # ELOOP / ENOTDIR: not a directory of ours
        log.warning("%s: the old spill files could not be listed (left alone): %s", where, exc)
        return
    try:
        for name in os.listdir(fd):
            if not _NAME.fullmatch(name) or name.startswith(_token + "-"):
                continue
            try:
                if stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("%s: an old spill file could not be removed: %s", where, exc)
    except OSError as exc:
        log.warning("%s: the old spill files could not be listed: %s", where, exc)
    finally:
        os.close(fd)


def margin(directory: str) -> tuple[int, int]:
    """``(free, least)``: the bytes free on ``directory``'s disk and the least a write must leave."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize, max(FREE_MIN_BYTES, int(st.f_blocks * st.f_frsize * FREE_MIN_FRACTION))


def paused() -> bool:
    """Whether writes are held back now (:data:`BACKOFF_S` after a failure or a refusal)."""
    return _clock() < _resume_at


def pause() -> None:
    """A write failed or was refused: none for :data:`BACKOFF_S`."""
    global _resume_at
    _resume_at = _clock() + BACKOFF_S


def room(directory: str, size: int) -> None:
    """Raise :class:`SpillRefused` unless ``size`` bytes may be written in ``directory`` now."""
    if paused():
        raise SpillRefused(errno.ENOSPC, f"no write for {BACKOFF_S:.0f} s after a failure or a full disk")
    free, least = margin(directory)
    if free - size < least:
        pause()
        raise SpillRefused(
            errno.ENOSPC, f"{free >> 20} MiB free on the journal's disk, less than {least >> 20} MiB"
        )


def written() -> None:
    """A write succeeded: a later failure warns again."""
    global _resume_at, _warned
    _resume_at, _warned = 0.0, False


def spill_failed(exc: OSError) -> None:
    """Log a failed or refused write of a spill file: a warning, then debug until a write succeeds.

    The map stays in memory (over the cap). A full disk is reported as a pause by the ledger's
    and the checkpoint's writes already (:mod:`hybridq.forwarder.disk_full`).
    """
    global _warned
    what = "not written" if isinstance(exc, SpillRefused) else "write failed"
    if _warned:
        log.debug("the ledger index's spill file: %s (%s): kept in memory", what, exc)
        return
    _warned = True
    log.warning(
        "the ledger index's spill file: %s (%s): finished jobs kept in memory, no spill for %.0f s",
        what,
        exc,
        BACKOFF_S,
    )
