"""Helpers for leaving journals in the states crashes leave them in."""

from __future__ import annotations

import os

from hybridq.journal import JournalWriter


def abandon_writer(writer: JournalWriter) -> None:
    """Drop a writer the way SIGKILL would: its segment stays unsealed and its flock is released."""
    seg = writer._segment
    if seg is not None:
        os.close(seg.fd)
    writer._segment = None
    writer._closed = True
