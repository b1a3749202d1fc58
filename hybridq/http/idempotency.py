"""``Idempotency-Key`` for ``POST /v1/jobs``: one job per key, across server restarts (docs/http.md).

The job id is derived from the key (:func:`key_job_id`: ``http-`` and a hash), so the journal
itself is the durable key store: a retried POST looks its id up and answers with it instead of
writing a second record. The lookups are cheap:

* ids this process wrote, and those in the journal past the lookup index's marks when the server
  started (read once, at the first keyed POST), are held in memory with the call's fingerprint;
* anything older is one primary-key read of the forwarder's lookup index
  (:func:`hybridq.lookup.find`) and one record read.

So nothing but the index and this process's memory is asked, and a missed id is one the journal
does not hold. A key whose write failed (the outcome unknown: the record may be in the file) is
looked up in the journal itself (:func:`hybridq.fetch_job`) from then on. A retried key with a
different call (task, queue, arguments) is refused (:class:`KeyReused`, a 422); a job whose
arguments were compacted away is taken as the same call.

The same key on two POSTs at once: the second waits for the first (a lock per key) and answers
with its id.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from hybridq import lookup
from hybridq.envelope import Envelope
from hybridq.errors import EnvelopeError, JournalError
from hybridq.job import call_fingerprint, fetch_job
from hybridq.journal import JournalReader, RecordType

__all__ = ["ID_PREFIX", "MAX_KEY", "KeyReused", "KeyStore", "fingerprint", "key_job_id", "valid_key"]

#: The prefix of job ids derived from an ``Idempotency-Key``.
ID_PREFIX = "http-"
#: Longest ``Idempotency-Key`` accepted (characters).
MAX_KEY = 255
#: Ids held in memory before the store falls back to reading the journal for misses.
MAX_REMEMBERED = 200_000


class KeyReused(ValueError):
    """The key was used before for another call; its job's id is :attr:`job_id`."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        super().__init__(
            f"this Idempotency-Key was used for another call (job {job_id}): "
            "a retry must send the same task, queue, args and kwargs"
        )


def valid_key(key: str) -> bool:
    """Whether ``key`` is usable: 1 to :data:`MAX_KEY` printable ASCII characters."""
    return 0 < len(key) <= MAX_KEY and key.isascii() and key.isprintable()


def key_job_id(key: str) -> str:
    """The job id of the job a POST with ``key`` makes (the same for every retry)."""
    digest = hashlib.blake2b(key.encode(), digest_size=16, person=b"hybridq-http-key").hexdigest()
    return ID_PREFIX + digest


def fingerprint(env: Envelope) -> bytes:
    """What a retry must repeat: the call (function, queue, arguments), hashed."""
    return hashlib.blake2b(call_fingerprint(env).encode(), digest_size=16).digest()


#: A compacted job's call is unknown: any retry matches it.
_UNKNOWN = b""


class _Held:
    """One key's lock and the POSTs holding or awaiting it."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class KeyStore:
    """Which keyed jobs the journal holds, and their calls (see the module docstring).

    Args:
        journal: the journal directory.
    """

    def __init__(self, journal: str) -> None:
        self.journal = journal
        self._known: dict[str, bytes] = {}
        self._uncertain: set[str] = set()
        self._complete = True  # _known holds every keyed id past the index (else: read the journal)
        self._loaded = False
        self._load_lock = threading.Lock()
        self._locks: dict[str, _Held] = {}

    @asynccontextmanager
    async def hold(self, job_id: str) -> AsyncIterator[None]:
        """Serialize the POSTs of one key (on the server's event loop)."""
        held = self._locks.get(job_id)
        if held is None:
            held = self._locks[job_id] = _Held()
        held.users += 1  # dropped when the last POST holding or awaiting it is done, not before
        try:
            async with held.lock:
                yield
        finally:
            held.users -= 1
            if not held.users:
                del self._locks[job_id]

    def _load(self) -> None:
        """Remember the keyed jobs past the index's marks (once; blocking: call from a thread)."""
        with self._load_lock:
            if self._loaded:
                return
            marks = lookup.journal_marks(self.journal)
            needle = f'"id":"{ID_PREFIX}'.encode()
            reader = JournalReader(self.journal)
            for record in reader.records(lookup.readable_marks(self.journal, marks or {})):
                if record.rtype != RecordType.DATA or needle not in record.payload:
                    continue
                try:
                    env = Envelope.from_bytes(record.payload)
                except (EnvelopeError, ValueError):
                    continue
                if env.id.startswith(ID_PREFIX):
                    self._known[env.id] = fingerprint(env)
            self._loaded = True

    def find(self, job_id: str) -> bytes | None:
        """The fingerprint of the journal's job ``job_id`` (``b""``: unknown); ``None``: no such job.

        Blocking (reads files): call from a thread.
        """
        self._load()
        known = self._known.get(job_id)
        if known is not None:
            return known
        if self._complete and job_id not in self._uncertain and lookup.find(self.journal, job_id) is None:
            return None
        try:
            job = fetch_job(job_id, self.journal)
        except JournalError:
            return None
        if job is None:
            return None
        self._uncertain.discard(job_id)
        record = job.record
        if lookup.segment_gone(self.journal, (record.writer_id, record.segment, record.offset)):
            return _UNKNOWN  # compacted: its arguments are gone
        return fingerprint(job.envelope)

    def remember(self, job_id: str, print_: bytes) -> None:
        """``job_id`` is durable now, for the call ``print_``."""
        if len(self._known) >= MAX_REMEMBERED:
            self._known.clear()
            self._complete = False  # from now on a miss reads the journal (slower, still exact)
        self._known[job_id] = print_
        self._uncertain.discard(job_id)

    def unsure(self, job_id: str) -> None:
        """Writing ``job_id`` failed with an unknown outcome: its record may be in the journal."""
        self._uncertain.add(job_id)

    def check(self, job_id: str, found: bytes | None, print_: bytes) -> bool:
        """Whether the job exists already (``True``: answer with it); raise if for another call."""
        if found is None:
            return False
        if found not in (_UNKNOWN, print_):
            raise KeyReused(job_id)
        return True
