"""``Idempotency-Key`` for ``POST /v1/jobs``: one job per key, across server restarts (docs/http.md).

The job id is derived from the key (:func:`key_job_id`: ``http-`` and a hash), so the journal
itself is the durable key store: a retried POST looks its id up and answers with it instead of
writing a second record. The lookups are cheap:

* ids this process wrote, and those in the journal past the lookup index's marks when the server
  started (read once, at the first keyed POST), are held in memory with the call's fingerprint;
* anything older is one primary-key read of the forwarder's lookup index
  (:func:`hybridq.lookup.reads.find`) and one record read.

So nothing but the index and this process's memory is asked, and a missed id is one the journal
does not hold, as long as the index is at least as far as it was when the tail was read: a miss
from an index that is gone, being rebuilt, busy or behind those marks proves nothing, and the
journal itself is read instead (every chain, from its first segment). A journal that cannot be
read raises (the POST answers 503): never taken as "absent". A key whose write failed (the
outcome unknown: the record may be in the file) is looked up in the journal itself
(:func:`hybridq.fetch_job`) from then on. A retried key with a different call (task, queue,
arguments, delay, retry) is refused (:class:`KeyReused`, a 422); a job whose arguments were
compacted away is taken as the same call. Keys are per token: the job id is derived from the key
and the token the POST carried, so two token holders' keys never meet.

The same key on two POSTs at once: the second waits for the first (a lock per key) and answers
with its id.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from hybridq.envelope.model import Envelope
from hybridq.errors import EnvelopeError, KeyReused
from hybridq.job import call_fingerprint, fetch_job
from hybridq.journal import ChainPosition, JournalReader, RecordType
from hybridq.lookup import reads as lookup

__all__ = [
    "ID_PREFIX",
    "MAX_KEY",
    "KeyReused",
    "KeyStore",
    "fingerprint",
    "key_job_id",
    "owned_by",
    "scoped_key",
    "valid_key",
]

#: The prefix of job ids derived from an ``Idempotency-Key``.
ID_PREFIX = "http-"
#: Longest ``Idempotency-Key`` accepted (characters).
MAX_KEY = 255
#: Ids held in memory before the store falls back to reading the journal for misses.
MAX_REMEMBERED = 200_000


def valid_key(key: str) -> bool:
    """Whether ``key`` is usable: 1 to :data:`MAX_KEY` printable ASCII characters."""
    return 0 < len(key) <= MAX_KEY and key.isascii() and key.isprintable()


def key_job_id(key: str, scope: str = "", node: str = "") -> str:
    """The job id of the job a POST with ``key`` makes (the same for every retry).

    ``scope``: whose key it is (:func:`hybridq.http.auth.token_scope` of the token the POST
    carried; ``""`` without tokens, which derives the id as before keys had scopes): one token's
    key never names another token's job. ``node``: the journal's node name
    (:func:`hybridq.http.node.node_name`), which the id carries (``http-<node>-<hash>``): the
    same key retried on another node makes another id there, and the id says where it is.
    """
    material = key.encode() if not scope else b"%s\0%s" % (scope.encode(), key.encode())
    digest = hashlib.blake2b(material, digest_size=16, person=b"hybridq-http-key").hexdigest()
    return f"{ID_PREFIX}{node}-{digest}" if node else ID_PREFIX + digest


def scoped_key(key: str, scope: str) -> str:
    """The idempotency key the job of a POST carries: ``token-<scope's 16 hex>:<key>``.

    Scoped like the id (:func:`key_job_id`): the forwarder merges jobs of one key, and two
    tokens' keys differ. ``scope`` ``""`` (no tokens): the key as sent.
    """
    return f"token-{scope[:16]}:{key}" if scope else key


def owned_by(env: Envelope, scope: str) -> bool:
    """Whether the job was enqueued over HTTP with a key by the token of ``scope`` (``""``: anyone)."""
    if not env.id.startswith(ID_PREFIX):
        return False
    return not scope or env.idempotency_key.startswith(scoped_key("", scope))


def fingerprint(env: Envelope) -> bytes:
    """What a retry must repeat: the call, its delay, retry, priority and limit key, hashed.

    The priority and limit key count only when set: keys stored before they existed still match.

    The delay is read back from the envelope (``run_at - created_at``, to the millisecond): the
    journal keeps when the job may run, not the number the POST sent.
    """
    delay = 0 if env.run_at is None else max(0, round((env.run_at - env.created_at) * 1000))
    retry = None if env.retry is None else env.retry.to_json()
    parts: list[Any] = [call_fingerprint(env), delay, retry]
    if env.priority or env.limit_key is not None:
        parts += (env.priority, env.limit_key)
    whole = json.dumps(parts, sort_keys=True)
    return hashlib.blake2b(whole.encode(), digest_size=16).digest()


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
        #: The index's journal marks when the tail was read (``None``: there was no index, so
        #: the whole journal was read and every keyed id is in memory).
        self._marks: dict[str, ChainPosition] | None = None
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
            self._marks = marks
            self._loaded = True

    def find(self, job_id: str) -> bytes | None:
        """The fingerprint of the journal's job ``job_id`` (``b""``: unknown); ``None``: no such job.

        Blocking (reads files): call from a thread.

        Raises:
            JournalError: the journal cannot be read (not known to be absent: a 503).
        """
        self._load()
        known = self._known.get(job_id)
        if known is not None:
            return known
        if self._complete and job_id not in self._uncertain:
            if self._marks is None:
                return None  # the whole journal was read at start: the miss is exact
            checked = lookup.find_checked(self.journal, job_id)
            if checked is not None and _covers(checked[0], self._marks):
                if checked[1] is None:
                    return None
            else:  # no index, or one behind the start's: its miss proves nothing
                return self._scan(job_id)
        job = fetch_job(job_id, self.journal)
        if job is None:
            return None
        self._uncertain.discard(job_id)
        record = job.record
        if lookup.segment_gone(self.journal, (record.writer_id, record.segment, record.offset)):
            return _UNKNOWN  # compacted: its arguments are gone
        return fingerprint(job.envelope)

    def _scan(self, job_id: str) -> bytes | None:
        """The fingerprint of ``job_id`` read from the whole journal (the index cannot say)."""
        record = lookup.scan_tail(self.journal, job_id, None)
        if record is None:
            return None
        try:
            return fingerprint(Envelope.from_bytes(record.payload))
        except (EnvelopeError, ValueError):
            return _UNKNOWN

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


def _covers(now: dict[str, ChainPosition], start: dict[str, ChainPosition]) -> bool:
    """Whether an index at marks ``now`` has read every chain at least as far as ``start``."""
    for chain, mark in start.items():
        at = now.get(chain)
        if at is None or (at.segment, at.offset) < (mark.segment, mark.offset):
            return False
    return True
