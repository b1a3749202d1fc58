"""Inputs and properties shared by ``tests/unit/test_fuzz.py`` and ``scripts/fuzz_targets.py``.

A template journal (one sealed segment of known records) is written once. Fuzzed bytes are then
written under the template segment's file name, so the reader gets past the name check and on
to the header and the records; the template's payloads say what was really written.

The properties of what Redis hands back and what the forwarder hands to Redis:
:func:`check_job_hash` (a decoded envelope becomes a job hash redis-py can encode, with numbers
RQ can take) and :func:`check_event` (a completion event parses into a ledger entry that
round-trips, or raises only the errors the forwarder drops an event for).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import redis
from hybridq.envelope.limits import MAX_SECONDS, MAX_TIMESTAMP
from hybridq.envelope.model import Envelope
from hybridq.journal import JournalReader, JournalWriter
from hybridq.ledger.entries import Entry, parse_event
from hybridq.transport.base import Delivery
from hybridq.transport.rq import RQTransport, _decode_event


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


# -- the job hash and completion events ---------------------------------------------------------

#: What ``Harvester._entry`` drops an event for; anything else would stop the forwarder.
EVENT_ERRORS = (KeyError, TypeError, ValueError, OverflowError)
_TRANSPORT: RQTransport | None = None


def _transport() -> RQTransport:
    """An RQ transport that never connects (building a job hash talks to no server)."""
    global _TRANSPORT
    if _TRANSPORT is None:
        _TRANSPORT = RQTransport(connection=redis.Redis(host="127.0.0.1", port=1))
    return _TRANSPORT


def check_job_hash(env: Envelope) -> None:
    """The job hash of a decoded envelope: built without error, every field redis-py encodes, and
    times and durations within what RQ (``datetime``, ``signal.alarm``, EXPIRE) takes."""
    fields = _transport().job_hash(Delivery(env, "owner", ("w" * 16, 0, 64)), "2026-01-01T00:00:00.000000Z")
    encoder = _transport().connection.get_encoder()  # what redis-py does to every argument
    for value in fields:
        encoder.encode(value)
    named = dict(zip(fields[::2], fields[1::2], strict=True))
    for name in ("timeout", "result_ttl"):
        if name in named:
            assert 1 <= int(named[name]) <= MAX_SECONDS, (name, named[name])
    assert 0 <= env.created_at <= MAX_TIMESTAMP


def _refuse_constant(name: str) -> None:
    raise AssertionError(f"{name} in an encoded ledger entry")


def check_event(raw: bytes) -> Entry | None:
    """A completion event's bytes as the forwarder reads them from Redis.

    Returns the entry it stands for (which encodes as strict JSON and decodes to itself), or
    ``None`` when it is dropped; raises only when the property does not hold.
    """
    body = _decode_event({b"e": raw})
    try:
        entry = parse_event("1-0", body, lambda: 1_700_000_000.0)
    except EVENT_ERRORS:
        return None
    encoded = entry.to_bytes()
    json.loads(encoded, parse_constant=_refuse_constant)  # no NaN or Infinity reaches the ledger
    assert Entry.from_bytes(encoded) == entry, (entry, encoded)
    return entry
