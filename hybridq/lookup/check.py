"""The lookup index's integrity check, off the forwarder's start path.

``PRAGMA quick_check`` reads the whole index file (0.37 s at a million jobs): at open it held the
first push back by that much. It runs on a thread of its own
(:class:`~hybridq.ledger.filecheck.FileCheck`); the forwarder asks for the verdict at each step
and, until it has one, treats the index as while it is rebuilt
(:attr:`hybridq.lookup.index.LookupIndex.building`). A damaged file is then replaced and
rebuilt, as at open.

This module must not import redis or rq.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridq.ledger.filecheck import FileCheck

__all__ = ["IndexCheck"]


class IndexCheck(FileCheck):
    """One ``quick_check`` of the index file at ``path``, on its own thread (see module docstring)."""

    def __init__(self, path: str, done: Callable[[], None] | None = None) -> None:
        super().__init__(path, done, name="hybridq-lookup-check")
