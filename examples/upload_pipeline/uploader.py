"""One uploader process: ``python uploader.py ROOT PREFIX FIRST COUNT``.

Stands in for a web server receiving uploads: it stores the files ``PREFIX-FIRST`` ...
``PREFIX-(FIRST+COUNT-1)`` (made-up bytes) through :func:`uploads.upload` and prints
``acked NAME`` once each is acknowledged to its client. A client whose upload was not
acknowledged may send it again (run.py restarts a dead uploader from its first unacknowledged
file) or give up (run.py skips it): either way the file is processed once. At start it sweeps
``incoming/`` (:func:`uploads.sweep`): a file an uploader stored and died before enqueueing is
processed too, once it is a few minutes old.
"""

from __future__ import annotations

import os
import sys

import uploads


def content(name: str) -> bytes:
    """The bytes a client uploads as ``name`` (the same on every retry)."""
    return f"the contents of {name}\n".encode() * 64


def main(argv: list[str]) -> None:
    """Upload the files ``argv`` names (see the module docstring)."""
    root, prefix, first, count = argv[0], argv[1], int(argv[2]), int(argv[3])
    for sub in ("incoming", "ready", "processed"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    for name in uploads.sweep(root):
        print("swept", name, flush=True)
    for i in range(first, first + count):
        name = f"{prefix}-{i:04d}"
        uploads.upload(root, name, content(name))
        print("acked", name, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
