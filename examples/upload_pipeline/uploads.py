"""The upload pipeline, intent first (docs/recipes/intent-first.md).

An upload lands in ``incoming/``, is published by moving it into ``ready/``, and is then
processed. The move is a side effect outside any database, so it cannot commit together with
the enqueue. The order that loses nothing and runs nothing for a move that never happened:

1. write the bytes into ``incoming/`` (durably);
2. record the intent: enqueue the processing under the key ``upload:<name>``;
3. do the side effect: move the file into ``ready/``.

The task does step 3 itself if it is still pending. Whichever of the uploader and the task
renames the file first wins; the other finds it gone, which is fine.

An uploader that dies between steps 1 and 2 leaves a file in ``incoming/`` with no job (its
client got no acknowledgement, and may never send it again): :func:`sweep`, run when an
uploader starts, enqueues every file left there longer than a few minutes.

The journal is ``$HYBRIDQ_JOURNAL``; a worker runs the task with ``hybridq worker --allow
uploads uploads``, started in this directory.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time

import hybridq

__all__ = ["SWEEP_AFTER_S", "process_upload", "publish", "sweep", "upload"]

#: How long a file waits in ``incoming/`` before :func:`sweep` takes it for a dead uploader's: far
#: longer than an upload takes between its write and its enqueue (milliseconds).
SWEEP_AFTER_S = 300.0


@hybridq.task(queue="uploads")
def process_upload(root: str, name: str) -> str:
    """Publish ``name`` if its uploader has not yet, then process it; return its SHA-256."""
    publish(root, name)
    with open(os.path.join(root, "ready", name), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    # The processing's output: replaced whole, so a second run would leave the same file ...
    _write_durably(os.path.join(root, "processed", name + ".sha256"), digest.encode())
    # ... and one audit line per run, so that a second processing would show (run.py counts them).
    _append_line(os.path.join(root, "processed.log"), f"{name} {digest}")
    return digest


def upload(root: str, name: str, data: bytes) -> None:
    """Store one upload and have it processed: returns once both are certain to happen."""
    _write_durably(os.path.join(root, "incoming", name), data)
    process_upload.enqueue_call((root, name), idempotency_key=f"upload:{name}")
    _crash_point(name)  # the intent is recorded, the move not done: tests kill uploaders here
    publish(root, name)


def sweep(root: str, older_than_s: float = SWEEP_AFTER_S) -> list[str]:
    """Enqueue the processing of every file in ``incoming/`` older than ``older_than_s``; their names.

    Such a file was stored by an uploader that died before its enqueue returned. Nothing is
    checked first: a file whose job exists already (its uploader died after the enqueue, before
    the move) is enqueued again under the same key, and the forwarder records that second job
    as a duplicate and never delivers it (enqueue-if-absent, docs/enqueue.md). A temporary
    file (``.NAME.PID.tmp``: a write cut short) is no upload and is left alone.
    """
    cutoff = time.time() - older_than_s
    swept = []
    with os.scandir(os.path.join(root, "incoming")) as entries:
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_file():
                continue
            try:
                if entry.stat().st_mtime > cutoff:
                    continue
            except FileNotFoundError:
                continue  # another uploader (or the task) published it while this one listed
            process_upload.enqueue_call((root, entry.name), idempotency_key=f"upload:{entry.name}")
            swept.append(entry.name)
    return swept


def publish(root: str, name: str) -> None:
    """Move ``name`` from ``incoming/`` into ``ready/`` unless that happened already."""
    try:
        os.rename(os.path.join(root, "incoming", name), os.path.join(root, "ready", name))
    except FileNotFoundError:
        return  # the other side (uploader or task) moved it first
    _fsync_dir(os.path.join(root, "ready"))


def _write_durably(path: str, data: bytes) -> None:
    """Write ``path`` whole (a temporary file renamed over it), fsync'd before it is visible."""
    directory, base = os.path.split(path)
    tmp = os.path.join(directory, f".{base}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(directory)


def _append_line(path: str, line: str) -> None:
    # One write() on an O_APPEND file: concurrent writers' lines never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crash_point(name: str) -> None:
    # For the crash test and run.py --crashes: die like `kill -9` between the two steps.
    if name in os.environ.get("UPLOADS_DIE_AFTER_ENQUEUE", "").split(","):
        os.kill(os.getpid(), signal.SIGKILL)
