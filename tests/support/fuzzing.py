"""Journals made of arbitrary bytes, shared by ``tests/unit/test_fuzz.py`` and ``scripts/fuzz_targets.py``.

A template journal (one sealed segment of known records) is written once. Fuzzed bytes are then
written under the template segment's file name, so the reader gets past the name check and on
to the header and the records; the template's payloads say what was really written.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hybridq.journal import JournalReader, JournalWriter


@dataclass(frozen=True)
class TemplateJournal:
    """A written journal of one sealed segment."""

    root: Path
    #: The file name of its one segment.
    segment: str
    #: That segment's bytes.
    raw: bytes
    #: Every payload written, by sequence number.
    written: dict[int, bytes]


def default_payloads() -> list[bytes]:
    """Twelve small payloads of assorted lengths, as ``test_fuzz.py`` has always used."""
    return [b"payload-%d-" % i + bytes(range(i * 7 % 50)) for i in range(12)]


def make_template_journal(
    root: Path, payloads: Iterable[bytes] | None = None, *, batches: Iterable[list[bytes]] = ()
) -> TemplateJournal:
    """Write ``payloads`` one append each, then each of ``batches`` as one ``append_many``, and seal.

    ``root`` must not hold a journal yet. Batches give records unsynced distances above one.
    """
    written: dict[int, bytes] = {}
    with JournalWriter(root) as writer:
        for payload in default_payloads() if payloads is None else payloads:
            written[writer.append(payload).seq] = payload
        for batch in batches:
            for rid, payload in zip(writer.append_many(batch), batch, strict=True):
                written[rid.seq] = payload
    [segment] = [p.name for p in root.glob("*.wal")]
    return TemplateJournal(root, segment, (root / segment).read_bytes(), written)


def write_segment(directory: Path, name: str, raw: bytes, *, sealed: bool = True) -> Path:
    """Write ``raw`` as segment ``name`` of ``directory`` (replacing it): 0400 if sealed, else 0600.

    An unsealed segment is the last one of a writer that died (nobody holds its lock).
    """
    path = directory / name
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view) :]
        if sealed:
            os.fchmod(fd, 0o400)
    finally:
        os.close(fd)
    return path


def journal_with(raw: bytes, segment: str, *, sealed: bool = True) -> Path:
    """A new 0700 temporary journal directory whose only segment is ``raw`` (the caller removes it)."""
    path = Path(tempfile.mkdtemp(prefix="hq-fuzz-"))
    path.chmod(0o700)
    write_segment(path, segment, raw, sealed=sealed)
    return path


def read_all(path: Path) -> list[tuple[int, bytes]]:
    """Every data record of the journal at ``path`` as ``(seq, payload)``."""
    return [(r.seq, r.payload) for r in JournalReader(str(path)).records()]
